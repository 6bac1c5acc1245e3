"""The @gluon.jit body of pallas_kernels.gluon_decode_attention (that module's docstring says what it computes and
bench/NOTES_gluon.md how it is laid out): HACK decode over the sealed blocks of the 2-bit kivi cache with the
scale-folded f16 operands and (DENSE) over the bf16 sinks and open region, one warp per program, explicit mma_v2
layouts; one row of (acc, m, l) partials per program out (m in natural-log units, rows at stride ROWS). Kept
apart so that the host-side module imports without Triton."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2


def _plane_asm(j):
    # plane j of 4 packed bytes ($2) as f16 subnormals code * 4**j * 2**-24: bytes 0, 1 -> $0 and 2, 3 -> $1 (PRMT
    # each pair under zero bytes, one AND per 2 codes). The PRMTs are the same for the 4 planes of a word, so
    # ptxas computes them once; the chunk-outer loop keeps the words whose planes are pending few (16 registers)
    m = (3 << (2 * j)) * 0x00010001
    return ("{ .reg .b32 z, lo, hi; mov.b32 z, 0; prmt.b32 lo, $2, z, 0x4140; prmt.b32 hi, $2, z, 0x4342; "
            f"and.b32 $0, lo, 0x{m:08X}; and.b32 $1, hi, 0x{m:08X}; }}")


PLANE0 = gl.constexpr(_plane_asm(0))
PLANE1 = gl.constexpr(_plane_asm(1))
PLANE2 = gl.constexpr(_plane_asm(2))
PLANE3 = gl.constexpr(_plane_asm(3))
# movmatrix: each 8x8 16-bit tile of a C-layout tensor (lane (g, t) holding row g, columns 2t, 2t+1) transposed
# across the warp, one instruction per 32-bit register
MOVM = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")
# cp.async staging (ASYNC >= 16): single [1, 64 tokens, 128 channels] K and [1, 128 channels, 64 tokens] V u8 tiles,
# 16-byte chunks XOR-swizzled by row so that the LK / LV reads are free of bank conflicts; copied 16 bytes a lane
SMEM_K = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0]))
SMEM_V = gl.constexpr(gl.SwizzledSharedLayout(vec=16, per_phase=2, max_phase=4, order=[1, 0]))
COPY_K = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [1, 1], [1, 0]))  # [64, 128]: 16 bytes a lane
COPY_V = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [1, 1], [1, 0]))  # [128, 64]
# metadata staging (META = (ASYNC // 4) % 4 = 1: k_scale, v_scale, v_min): a group's [4, 128] f16 K scale rows (16
# bytes a lane) and [256, 2] f16 per-token pairs (4 bytes a lane, rows in logical token order), unswizzled
SMEM_M = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
COPY_KS = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0]))  # [4, 128]
COPY_VM = gl.constexpr(gl.BlockedLayout([1, 2], [32, 1], [1, 1], [1, 0]))  # [256, 2]
# [P, 2] per-token (group 0, group 1) metadata pairs: rows as the mma C layout's (lane // 4 + 8 i), the pair
# in-thread
P_BLK = gl.constexpr(64)  # the partition size the kernel covers (static_assert in the kernel)
T2 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[8, 4], warps_per_cta=[1, 1],
                                   order=[1, 0]))


@gluon.jit
def _copy_k(ksm, ksc, k_codes_ptr, k_scale_ptr, pid, gi, h, ok, H: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
            PAGE: gl.constexpr, META: gl.constexpr):
    # cp.async of one packing group's K tile (rows in logical token order: row r <- physical token _tok(r)) and,
    # META 1, its 4 blocks' K scale rows; where not ok, zeros are written
    # (callers copy into a buffer only after its last read)
    ko, _, meta0, _ = _group_offsets(pid, gi, h, H, D, P, PAGE)
    rk = gl.arange(0, P, layout=gl.SliceLayout(1, COPY_K))
    ck = gl.arange(0, D, layout=gl.SliceLayout(0, COPY_K))
    ksrc = k_codes_ptr + ko + _tok(rk)[:, None] * D + ck[None, :]
    async_copy.async_copy_global_to_shared(ksm, ksrc, mask=ok & (ck < D)[None, :])
    if META >= 1:
        rs = gl.arange(0, 4, layout=gl.SliceLayout(1, COPY_KS))
        cs = gl.arange(0, D, layout=gl.SliceLayout(0, COPY_KS))
        soff = meta0 + rs[:, None] * D + cs[None, :]
        async_copy.async_copy_global_to_shared(ksc, k_scale_ptr + soff, mask=ok & (cs < D)[None, :])


@gluon.jit
def _copy_v(vsm, vsc, vmn, v_codes_ptr, v_scale_ptr, v_min_ptr, pid, gi, h, ok, H: gl.constexpr, D: gl.constexpr,
            P: gl.constexpr, PAGE: gl.constexpr, META: gl.constexpr):
    # cp.async of one packing group's V tile (memory order) and, META 1, its 256 tokens' (tau, nu) pairs
    # (rows in logical token order)
    _, vo, _, tmeta0 = _group_offsets(pid, gi, h, H, D, P, PAGE)
    rv = gl.arange(0, D, layout=gl.SliceLayout(1, COPY_V))
    cv = gl.arange(0, P, layout=gl.SliceLayout(0, COPY_V))
    vsrc = v_codes_ptr + vo + rv[:, None] * (PAGE // 4) + cv[None, :]
    async_copy.async_copy_global_to_shared(vsm, vsrc, mask=ok & (cv < P)[None, :])
    if META >= 1:
        rt = gl.arange(0, 4 * P, layout=gl.SliceLayout(1, COPY_VM))
        ct = gl.arange(0, 2, layout=gl.SliceLayout(0, COPY_VM))
        toff = tmeta0 + ((rt // P) * P + _tok(rt % P))[:, None] * 2 + ct[None, :]
        async_copy.async_copy_global_to_shared(vsc, v_scale_ptr + toff, mask=ok & (ct < 2)[None, :])
        async_copy.async_copy_global_to_shared(vmn, v_min_ptr + toff, mask=ok & (ct < 2)[None, :])


@gluon.jit
def _group_pid(pid_cur, page_indices_ptr, b, grp, last, AHEAD: gl.constexpr, PPS: gl.constexpr, GPP: gl.constexpr,
               NUM_PAGES: gl.constexpr):
    # (group grp's page id, the id carried to the next group); AHEAD: the carried id is grp's and the next group's
    # is loaded now, a group ahead of its use
    if AHEAD:
        return pid_cur, _pid(page_indices_ptr, b, gl.minimum(grp + 1, last), PPS, GPP, NUM_PAGES)
    else:
        return _pid(page_indices_ptr, b, grp, PPS, GPP, NUM_PAGES), pid_cur


@gluon.jit
def _stages(NST: gl.constexpr, P: gl.constexpr, D: gl.constexpr, META: gl.constexpr):
    # NST stages of shared memory: the code tiles (ksm, vsm) and, META 1, the metadata (ksc, vsc, vmn); without,
    # those alias ksm (never written nor read)
    ksm = gl.allocate_shared_memory(gl.uint8, [NST, P, D], SMEM_K)
    vsm = gl.allocate_shared_memory(gl.uint8, [NST, D, P], SMEM_V)
    if META == 1:
        ksc = gl.allocate_shared_memory(gl.float16, [NST, 4, D], SMEM_M)
        vsc = gl.allocate_shared_memory(gl.float16, [NST, 4 * P, 2], SMEM_M)
        vmn = gl.allocate_shared_memory(gl.float16, [NST, 4 * P, 2], SMEM_M)
    else:
        ksc = ksm
        vsc = ksm
        vmn = ksm
    return ksm, vsm, ksc, vsc, vmn


@gluon.jit
def _group_offsets(pid, gi, h, H: gl.constexpr, D: gl.constexpr, P: gl.constexpr, PAGE: gl.constexpr):
    # element offsets of packing group gi of page pid, kv head h: its K code tile, its V code tile, block 0's
    # row of the K metadata (k_scale / k_min) and block 0's per-token (tau, nu) pairs
    ph = pid.to(gl.int64) * H + h
    return (ph * (PAGE // 4 * D) + gi * (P * D), ph * (D * PAGE // 4) + gi * P, (ph * (PAGE // P) + gi * 4) * D,
            (ph * PAGE + gi * 4 * P) * 2)


@gluon.jit
def _group_bases(k_codes_ptr, v_codes_ptr, pid, grp, h, H: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
                 PAGE: gl.constexpr):
    # packing group grp (on page pid) of kv head h: its index in the page, its K and V code tiles, block 0's
    # offset in the K metadata and in the per-token pairs (_group_offsets)
    gi = grp % (PAGE // (4 * P))
    ko, vo, meta0, tmeta0 = _group_offsets(pid, gi, h, H, D, P, PAGE)
    return gi, k_codes_ptr + ko, v_codes_ptr + vo, meta0, tmeta0


@gluon.jit
def _pid(page_indices_ptr, b, grp, PPS: gl.constexpr, GPP: gl.constexpr, NUM_PAGES: gl.constexpr):
    # page id of packing group grp of sequence b (ids outside the pool read page 0, the null page)
    pid = gl.load(page_indices_ptr + b * PPS + grp // GPP)
    return gl.where((pid >= 0) & (pid < NUM_PAGES), pid, 0)


@gluon.jit
def _plane(x, J: gl.constexpr):
    if J == 0:
        asm: gl.constexpr = PLANE0
    elif J == 1:
        asm: gl.constexpr = PLANE1
    elif J == 2:
        asm: gl.constexpr = PLANE2
    else:
        asm: gl.constexpr = PLANE3
    return gl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)


# The mma.m16n8k16 layouts of one warp: the accumulator (C), the A and B operands (k_width 2), C's rows
_MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
MMA = gl.constexpr(_MMA)
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))
ROW_C_MMA = gl.constexpr(gl.SliceLayout(1, _MMA))

# Physical-order layouts (one warp). The codes and the K-side B operand are loaded in memory order with wide
# loads, then relabelled (reshape / permute: no data movement) into the mma_v2 operand layouts (k_width 2), whose
# k index is then a permutation of the memory order; the dots are invariant under it when both operands share
# it. The layouts are chosen so that a 32-bit word of 4 code bytes is one inline-asm call whose two f16x2
# results are the pairs (k, k + 1) and (k + 8, k + 9) of the m16n8k16 fragment.
# K chunk [64 tokens, 32 channels] u8: lane t holds physical channels 8t..8t+7 (LDG.64): p = x0 + 2 x1 + 4 x2 +
# 8 t0 + 16 t1 is logical k = x0 + 2 t0 + 4 t1 + 8 x1 + 16 x2.
LK = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0], [16, 0], [32, 0]],
                                             lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                             warp_bases=[], block_bases=[], shape=[64, 32]))
LMU = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                              lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                              warp_bases=[], block_bases=[], shape=[16, 32]))
# K-side B [32 channels, 8 heads] f32 (q, q sigma): lane t holds physical channels 8t..8t+7 of head lane // 4
LQ = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [4, 0]],
                                             lane_bases=[[8, 0], [16, 0], [0, 1], [0, 2], [0, 4]],
                                             warp_bases=[], block_bases=[], shape=[32, 8]))
# a [1, 32] row of K scales from a stage, lanes / registers as LQ's channels (reshaped: SliceLayout(1, LQ))
LS1 = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4]],
                                              lane_bases=[[0, 8], [0, 16], [0, 0], [0, 0], [0, 0]],
                                              warp_bases=[], block_bases=[], shape=[1, 32]))
# V chunk [32 channels, 64 tokens] u8: lane t holds physical tokens 16t..16t+15 (LDG.128): p = x0 + 2 x1 + 4 x2 +
# 8 x3 + 16 t0 + 32 t1 is logical token k = x0 + 2 t0 + 4 t1 + 8 x1 + 16 x2 + 32 x3 (`_tok`), which the K side's
# rows and the per-token metadata follow
LV = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [16, 0]],
                                             lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                                             warp_bases=[], block_bases=[], shape=[32, 64]))


@gluon.jit
def _tok(k):
    # physical token of logical token k (the PV dot's k order)
    return (k & 1) + ((k >> 3) & 1) * 2 + ((k >> 4) & 1) * 4 + ((k >> 5) & 1) * 8 + ((k >> 1) & 1) * 16 + (
        (k >> 2) & 1) * 32


@gluon.jit
def _k_logical(x, A: gl.constexpr):
    # [R, 32] in physical channel order (LK / LMU) -> the A operand layout, logical k (no data movement)
    R: gl.constexpr = x.shape[0]
    y = x.reshape([R, 2, 2, 2, 2, 2]).permute(0, 3, 4, 1, 2, 5).reshape([R, 32])
    return gl.convert_layout(y, A, assert_trivial=True)


@gluon.jit
def _q_logical(x, B: gl.constexpr):
    # [32, 8] in physical channel order (LQ) -> the B operand layout
    y = x.reshape([2, 2, 2, 2, 2, 8]).permute(2, 3, 0, 1, 4, 5).reshape([32, 8])
    return gl.convert_layout(y, B, assert_trivial=True)


@gluon.jit
def _v_logical(x, A: gl.constexpr):
    # [32, 64] in physical token order (LV) -> the A operand layout, logical token k
    y = x.reshape([32, 2, 2, 2, 2, 2, 2]).permute(0, 3, 4, 5, 1, 2, 6).reshape([32, 64])
    return gl.convert_layout(y, A, assert_trivial=True)


@gluon.jit
def _to_b(x, B: gl.constexpr):
    # f16 [P, 8] in the C layout (rows: tokens) -> the same values in the PV dot's B layout: movmatrix leaves
    # Z[8 i + a, g] in the register that held x[8 i + g, a]; relabelled (reshape / permute) it is B (k_width 2)
    y = gl.inline_asm_elementwise(MOVM, "=r,r", [x], dtype=gl.float16, is_pure=True, pack=2)
    R: gl.constexpr = x.shape[0]
    z = y.reshape([R // 8, 8, 8]).permute(0, 2, 1).reshape([R, 8])
    return gl.convert_layout(z, B, assert_trivial=True)


@gluon.jit
def _ld(ptr, valid, MASKED: gl.constexpr):
    # a metadata load; MASKED (the last, partial group): invalid blocks read 0 (their slots may hold NaN)
    if MASKED:
        return gl.load(ptr, mask=valid, other=0.0)
    else:
        return gl.load(ptr)


@gluon.jit
def _sg(ptr, valid, ksc, J: gl.constexpr, C: gl.constexpr, MASKED: gl.constexpr, META: gl.constexpr):
    # block J's K scales of chunk C (f32 [32], physical channel order) from the stage or from memory
    if META >= 1:
        x = ksc.slice(J, 1, dim=0).slice(C * 32, 32, dim=1).load(LS1)  # [1, 32]
        return gl.convert_layout(x.reshape([32]), gl.SliceLayout(1, LQ), assert_trivial=True).to(gl.float32)
    else:
        return _ld(ptr, valid, MASKED).to(gl.float32)


@gluon.jit
def _qk_chunk(s0, s1, s2, s3, bacc, kc, qp, k_scale_ptr, k_min_ptr, meta, kq, v0, v1, v2, v3, mu_off, mu_mask, ksc,
              A: gl.constexpr, B: gl.constexpr, BD: gl.constexpr, MASKED: gl.constexpr, C: gl.constexpr,
              META: gl.constexpr):
    # one 32-channel chunk of the 4 blocks' logits: s_j += plane_j(kc) @ f16(q sigma_j) (kc already in A;
    # qp [32, 8] f32 in LQ); meta: block 0's metadata offset of the chunk's first channel, BD: one block's
    # metadata stride. bacc [16, 8] += mu_j . q for the 4 blocks (rows 0..3; q as two f16 parts: exact products)
    sg = _sg(k_scale_ptr + meta + kq, v0, ksc, 0, C, MASKED, META)
    s0 = mma_v2(_k_logical(_plane(kc, 0), A), _q_logical((qp * sg[:, None]).to(gl.float16), B), s0)
    sg = _sg(k_scale_ptr + meta + BD + kq, v1, ksc, 1, C, MASKED, META)
    s1 = mma_v2(_k_logical(_plane(kc, 1), A), _q_logical((qp * sg[:, None]).to(gl.float16), B), s1)
    sg = _sg(k_scale_ptr + meta + 2 * BD + kq, v2, ksc, 2, C, MASKED, META)
    s2 = mma_v2(_k_logical(_plane(kc, 2), A), _q_logical((qp * sg[:, None]).to(gl.float16), B), s2)
    sg = _sg(k_scale_ptr + meta + 3 * BD + kq, v3, ksc, 3, C, MASKED, META)
    s3 = mma_v2(_k_logical(_plane(kc, 3), A), _q_logical((qp * sg[:, None]).to(gl.float16), B), s3)
    mu = _k_logical(gl.load(k_min_ptr + meta + mu_off, mask=mu_mask, other=0.0), A)  # f16 [16, 32], rows >= 4: 0
    qhi = qp.to(gl.float16)
    qlo = (qp - qhi.to(gl.float32)).to(gl.float16)
    bacc = mma_v2(mu, _q_logical(qhi, B), bacc)
    bacc = mma_v2(mu, _q_logical(qlo, B), bacc)
    return s0, s1, s2, s3, bacc


@gluon.jit
def _row(x, rows, J: gl.constexpr):
    # row J of x [16, 8] (C layout) as [8] (COL_C)
    return gl.sum(gl.where((rows == J)[:, None], x, 0.0), axis=0)


@gluon.jit
def _block_weights(s, bias, m_new, valid, v_scale_ptr, v_min_ptr, tmeta2, vsc, vmn, sc, two_j, f, J: gl.constexpr,
                   B: gl.constexpr, ROW_C: gl.constexpr, META: gl.constexpr, MASKED: gl.constexpr):
    # block J's softmax weights against the group max m_new: (l, nu0, nu1 partial sums [8], B operands
    # f16(p tau_g 4**-J) [P, 8] for channel groups 0 and 1); tmeta2 [P, 2] offsets of (tau, nu) pairs (T2)
    # p 4**-J: the V plane's weight 4**J 2**-24 folded into the exponent (the sums below scale back); sc = 2**(24 -
    # 2 J) QK_SCALE, two_j = 2 J, f = 4**J
    p = gl.exp2(s * sc + (bias - m_new - two_j)[None, :])
    if MASKED:
        p = gl.where(valid, p, 0.0)
    if META >= 1:  # the stage's rows J P.. (logical token order)
        tau0, tau1 = gl.split(vsc.slice(J * P_BLK, P_BLK, dim=0).load(T2).to(gl.float32))
        nuv0, nuv1 = gl.split(vmn.slice(J * P_BLK, P_BLK, dim=0).load(T2).to(gl.float32))
    else:
        tau0, tau1 = gl.split(_ld(v_scale_ptr + tmeta2, valid, MASKED).to(gl.float32))
        nuv0, nuv1 = gl.split(_ld(v_min_ptr + tmeta2, valid, MASKED).to(gl.float32))
    tau0 = gl.convert_layout(tau0, ROW_C, assert_trivial=True)
    tau1 = gl.convert_layout(tau1, ROW_C, assert_trivial=True)
    nuv0 = gl.convert_layout(nuv0, ROW_C, assert_trivial=True)
    nuv1 = gl.convert_layout(nuv1, ROW_C, assert_trivial=True)
    b0 = _to_b((p * tau0[:, None]).to(gl.float16), B)
    b1 = _to_b((p * tau1[:, None]).to(gl.float16), B)
    return (gl.sum(p, axis=0) * f, gl.sum(p * nuv0[:, None], axis=0) * f, gl.sum(p * nuv1[:, None], axis=0) * f,
            b0, b1)


@gluon.jit
def _pv_chunk(acc, vc, b0, b1, b2, b3, A: gl.constexpr):
    # vc: a V chunk's codes in physical order (LV)
    acc = mma_v2(_v_logical(_plane(vc, 0), A), b0, acc)
    acc = mma_v2(_v_logical(_plane(vc, 1), A), b1, acc)
    acc = mma_v2(_v_logical(_plane(vc, 2), A), b2, acc)
    return mma_v2(_v_logical(_plane(vc, 3), A), b3, acc)


@gluon.jit
def _group(m_i, l_i, nu0_i, nu1_i, acc0, acc1, acc2, acc3, grp, pid, ksm, vsm, ksc, vsc, vmn, num_blocks, h,
           q_rows, qmask, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr, v_min_ptr, kq, k_off, rmu,
           cmu, mu_off, v_off, t_off, rowsC, pid_n, ok_n, H: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
           PAGE: gl.constexpr, QK_SCALE: gl.constexpr, MASKED: gl.constexpr, SMEM: gl.constexpr, META: gl.constexpr):
    # one packing group (4 blocks) into the running state; SMEM: its tiles through the single buffers (ksm, vsm;
    # META 1: its metadata too, ksc, vsc, vmn), this group's K tile already copied (or in flight): its V tile is
    # copied during QK^T, the next group's (pid_n, ok_n) K tile during PV; else everything loaded from memory
    GPP: gl.constexpr = PAGE // (4 * P)
    VCH: gl.constexpr = 32 * (PAGE // 4)  # one 32-channel V chunk of a page
    gi, kbase, vbase, meta0, tmeta0 = _group_bases(k_codes_ptr, v_codes_ptr, pid, grp, h, H, D, P, PAGE)
    v0 = grp * 4 < num_blocks
    v1 = grp * 4 + 1 < num_blocks
    v2 = grp * 4 + 2 < num_blocks
    v3 = grp * 4 + 3 < num_blocks
    meta = meta0
    mu_mask = ((rmu < 4) & (grp * 4 + rmu < num_blocks))[:, None] & (cmu < 32)[None, :]
    # QK^T: chunk-outer (32 channels of K codes live at a time), block-inner
    s0 = gl.zeros([P, 8], gl.float32, layout=MMA)
    s1 = gl.zeros([P, 8], gl.float32, layout=MMA)
    s2 = gl.zeros([P, 8], gl.float32, layout=MMA)
    s3 = gl.zeros([P, 8], gl.float32, layout=MMA)
    bacc = gl.zeros([16, 8], gl.float32, layout=MMA)
    if SMEM:
        _copy_v(vsm, vsc, vmn, v_codes_ptr, v_scale_ptr, v_min_ptr, pid, gi, h, True, H, D, P, PAGE, META)
        async_copy.commit_group()
        async_copy.wait_group(1)  # this group's K tile (the V copy may be in flight)
        gl.thread_barrier()
    for c in gl.static_range(4):
        if SMEM:  # this group's stage (rows already in logical token order)
            kc = ksm.slice(c * 32, 32, dim=1).load(LK)
        else:
            kc = gl.load(kbase + c * 32 + k_off)  # physical order (LK)
        qp = gl.load(q_rows + c * 32, mask=qmask, other=0.0).to(gl.float32)
        s0, s1, s2, s3, bacc = _qk_chunk(s0, s1, s2, s3, bacc, kc, qp, k_scale_ptr, k_min_ptr, meta + c * 32,
                                         kq, v0, v1, v2, v3, mu_off, mu_mask, ksc, A_OP, B_OP, D, MASKED, c, META)
    bias0 = _row(bacc, rowsC, 0) * QK_SCALE
    bias1 = _row(bacc, rowsC, 1) * QK_SCALE
    bias2 = _row(bacc, rowsC, 2) * QK_SCALE
    bias3 = _row(bacc, rowsC, 3) * QK_SCALE
    # one max over the group's 4 blocks (logits = QK_SCALE (s_j 2**(24 - 2 j) + q . mu_j), base 2)
    m0 = gl.where(v0, gl.max(s0, axis=0) * (2.0 ** 24 * QK_SCALE) + bias0, float("-inf"))
    m1 = gl.where(v1, gl.max(s1, axis=0) * (2.0 ** 22 * QK_SCALE) + bias1, float("-inf"))
    m2 = gl.where(v2, gl.max(s2, axis=0) * (2.0 ** 20 * QK_SCALE) + bias2, float("-inf"))
    m3 = gl.where(v3, gl.max(s3, axis=0) * (2.0 ** 18 * QK_SCALE) + bias3, float("-inf"))
    if SMEM:  # the K buffer read by every lane: refill it with the next group's
        gl.thread_barrier()
        _copy_k(ksm, ksc, k_codes_ptr, k_scale_ptr, pid_n, (grp + 1) % GPP, h, ok_n, H, D, P, PAGE, META)
        async_copy.commit_group()
        async_copy.wait_group(1)  # this group's V tile
        gl.thread_barrier()
    m_new = gl.maximum(gl.maximum(m_i, gl.maximum(m0, m1)), gl.maximum(m2, m3))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    m_i = m_new
    tmeta = tmeta0 + t_off
    la, n0a, n1a, b00, b01 = _block_weights(s0, bias0, m_safe, v0, v_scale_ptr, v_min_ptr, tmeta, vsc, vmn,
                                            2.0 ** 24 * QK_SCALE, 0.0, 1.0, 0, B_OP, ROW_C_MMA, META, MASKED)
    lb, n0b, n1b, b10, b11 = _block_weights(s1, bias1, m_safe, v1, v_scale_ptr, v_min_ptr, tmeta + 2 * P, vsc,
                                            vmn, 2.0 ** 22 * QK_SCALE, 2.0, 4.0, 1, B_OP, ROW_C_MMA, META,
                                            MASKED)
    lc, n0c, n1c, b20, b21 = _block_weights(s2, bias2, m_safe, v2, v_scale_ptr, v_min_ptr, tmeta + 4 * P, vsc,
                                            vmn, 2.0 ** 20 * QK_SCALE, 4.0, 16.0, 2, B_OP, ROW_C_MMA, META,
                                            MASKED)
    ld, n0d, n1d, b30, b31 = _block_weights(s3, bias3, m_safe, v3, v_scale_ptr, v_min_ptr, tmeta + 6 * P, vsc,
                                            vmn, 2.0 ** 18 * QK_SCALE, 6.0, 64.0, 3, B_OP, ROW_C_MMA, META,
                                            MASKED)
    l_i = l_i * alpha + (la + lb + lc + ld)
    nu0_i = nu0_i * alpha + (n0a + n0b + n0c + n0d)
    nu1_i = nu1_i * alpha + (n1a + n1b + n1c + n1d)
    # PV: chunk-outer (32 channels of V codes live at a time), block-inner, one rescale per group
    fa = alpha[None, :]
    if SMEM:
        vq0 = vsm.slice(0, 32, dim=0).load(LV)
        vq1 = vsm.slice(32, 32, dim=0).load(LV)
        vq2 = vsm.slice(64, 32, dim=0).load(LV)
        vq3 = vsm.slice(96, 32, dim=0).load(LV)
    else:
        vq0 = gl.load(vbase + v_off)
        vq1 = gl.load(vbase + VCH + v_off)
        vq2 = gl.load(vbase + 2 * VCH + v_off)
        vq3 = gl.load(vbase + 3 * VCH + v_off)
    acc0 = _pv_chunk(acc0 * fa, vq0, b00, b10, b20, b30, A_OP)
    acc1 = _pv_chunk(acc1 * fa, vq1, b00, b10, b20, b30, A_OP)
    acc2 = _pv_chunk(acc2 * fa, vq2, b01, b11, b21, b31, A_OP)
    acc3 = _pv_chunk(acc3 * fa, vq3, b01, b11, b21, b31, A_OP)
    if SMEM:  # the V buffer read by every lane before the next group's copy
        gl.thread_barrier()

    return m_i, l_i, nu0_i, nu1_i, acc0, acc1, acc2, acc3


# DENSE: the sinks and the open region (bf16 rows) in one program of each (sequence, kv head) (3: a program of
# their own; 2: the first split's, before its groups): plain
# [rows, 32] / [32, rows] tiles converted into the mma operands (once per program, not in the loop); q and the
# softmax weights as two bf16 parts (hi + lo: ~16-bit products against the exact bf16 K / V)
DENSE_K = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0]))  # [R, 32] K rows: 8 channels a lane
DENSE_V = gl.constexpr(gl.BlockedLayout([8, 1], [4, 8], [1, 1], [0, 1]))  # [32, R] V^T: 8 channels a lane
DENSE_Q = gl.constexpr(gl.BlockedLayout([8, 1], [4, 8], [1, 1], [0, 1]))  # [32, 8] q^T chunk


@gluon.jit
def _hi_lo(x, L: gl.constexpr):
    # f32 x -> (bf16 hi, bf16 lo) in layout L, x ~ hi + lo
    hi = x.to(gl.bfloat16)
    lo = (x - hi.to(gl.float32)).to(gl.bfloat16)
    return gl.convert_layout(hi, L), gl.convert_layout(lo, L)


@gluon.jit
def _dense_load(k_ptr, v_ptr, n_valid, D: gl.constexpr, R: gl.constexpr):
    # R bf16 rows at k_ptr / v_ptr (rows of D), the first n_valid real (the rest never read): the K rows as 4
    # [R, 32] chunks, V^T as 4 [32, R] chunks
    rk = gl.arange(0, R, layout=gl.SliceLayout(1, DENSE_K))
    ck = gl.arange(0, 32, layout=gl.SliceLayout(0, DENSE_K))
    rv = gl.arange(0, R, layout=gl.SliceLayout(0, DENSE_V))
    cv = gl.arange(0, 32, layout=gl.SliceLayout(1, DENSE_V))
    kp = k_ptr + rk[:, None] * D + ck[None, :]
    vp = v_ptr + rv[None, :] * D + cv[:, None]
    km = (rk < n_valid)[:, None] & (ck < 32)[None, :]
    vm = (rv < n_valid)[None, :] & (cv < 32)[:, None]
    return (gl.load(kp, mask=km, other=0.0), gl.load(kp + 32, mask=km, other=0.0),
            gl.load(kp + 64, mask=km, other=0.0), gl.load(kp + 96, mask=km, other=0.0),
            gl.load(vp, mask=vm, other=0.0), gl.load(vp + 32, mask=vm, other=0.0),
            gl.load(vp + 64, mask=vm, other=0.0), gl.load(vp + 96, mask=vm, other=0.0))


@gluon.jit
def _dense_logits(k0, k1, k2, k3, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, n_valid, R: gl.constexpr,
                  QK_SCALE: gl.constexpr):
    # base-2 logits [R, 8] of a tile's K rows against q (hi / lo B operands per chunk), -inf past n_valid
    s = _dense_qk(gl.zeros([R, 8], gl.float32, layout=MMA), k0, qh0, ql0)
    s = _dense_qk(s, k1, qh1, ql1)
    s = _dense_qk(s, k2, qh2, ql2)
    s = _dense_qk(s, k3, qh3, ql3)
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, MMA))
    return gl.where((rows < n_valid)[:, None], s * QK_SCALE, float("-inf"))


@gluon.jit
def _dense(m_i, l_i, acc0, acc1, acc2, acc3, ok_ptr, ov_ptr, sk_ptr, sv_ptr, num_open, num_sink, q_ptr, qrow0,
           QPK: gl.constexpr, D: gl.constexpr, W: gl.constexpr, NS: gl.constexpr, QK_SCALE: gl.constexpr):
    # the open region (W rows at ok_ptr / ov_ptr, num_open real) and the NS sinks (a tile of 16 rows at sk_ptr /
    # sv_ptr, num_sink real; NS <= 16) into the running state (acc in real units). Every load is issued before any
    # math; they exceed the registers, so the loaded values spill and several memory latencies pass (~14 us on an
    # H100 at 60 open tokens: bench/NOTES_gluon.md, session 27), hence DENSE 3's program of its own
    ok0, ok1, ok2, ok3, ov0, ov1, ov2, ov3 = _dense_load(ok_ptr, ov_ptr, num_open, D, W)
    if NS > 0:
        sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3 = _dense_load(sk_ptr, sv_ptr, num_sink, D, 16)
    cq = gl.arange(0, 32, layout=gl.SliceLayout(1, DENSE_Q))
    nq = gl.arange(0, 8, layout=gl.SliceLayout(0, DENSE_Q))
    qp = q_ptr + (qrow0 + nq)[None, :] * D + cq[:, None]
    qmask = (nq < QPK)[None, :] & (cq < 32)[:, None]
    qh0, ql0 = _hi_lo(gl.load(qp, mask=qmask, other=0.0).to(gl.float32), B_OP)
    qh1, ql1 = _hi_lo(gl.load(qp + 32, mask=qmask, other=0.0).to(gl.float32), B_OP)
    qh2, ql2 = _hi_lo(gl.load(qp + 64, mask=qmask, other=0.0).to(gl.float32), B_OP)
    qh3, ql3 = _hi_lo(gl.load(qp + 96, mask=qmask, other=0.0).to(gl.float32), B_OP)
    t = _dense_logits(ok0, ok1, ok2, ok3, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, num_open, W, QK_SCALE)
    m_new = gl.maximum(m_i, gl.max(t, axis=0))
    if NS > 0:
        ts = _dense_logits(sk0, sk1, sk2, sk3, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, num_sink, 16, QK_SCALE)
        m_new = gl.maximum(m_new, gl.max(ts, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    fa = alpha[None, :]
    p = gl.exp2(t - m_safe[None, :])  # 0 at -inf
    l_i = l_i * alpha + gl.sum(p, axis=0)
    phi, plo = _hi_lo(p, B_OP)
    acc0 = _dense_pv(acc0 * fa, ov0, phi, plo)
    acc1 = _dense_pv(acc1 * fa, ov1, phi, plo)
    acc2 = _dense_pv(acc2 * fa, ov2, phi, plo)
    acc3 = _dense_pv(acc3 * fa, ov3, phi, plo)
    if NS > 0:
        ps = gl.exp2(ts - m_safe[None, :])
        l_i = l_i + gl.sum(ps, axis=0)
        shi, slo = _hi_lo(ps, B_OP)
        acc0 = _dense_pv(acc0, sv0, shi, slo)
        acc1 = _dense_pv(acc1, sv1, shi, slo)
        acc2 = _dense_pv(acc2, sv2, shi, slo)
        acc3 = _dense_pv(acc3, sv3, shi, slo)
    return m_new, l_i, acc0, acc1, acc2, acc3


@gluon.jit
def _dense_part(m_i, l_i, acc0, acc1, acc2, acc3, b, h, kv_len, after_sinks, q_ptr, open_k_ptr, open_v_ptr,
                sink_k_ptr, sink_v_ptr, H: gl.constexpr, QPK: gl.constexpr, D: gl.constexpr, W: gl.constexpr,
                NS: gl.constexpr, QK_SCALE: gl.constexpr):
    # _dense at sequence b, kv head h: its open tokens and sinks
    num_open = after_sinks - (after_sinks // W) * W  # tokens in the open region
    bh = (b * H + h).to(gl.int64)
    return _dense(m_i, l_i, acc0, acc1, acc2, acc3, open_k_ptr + bh * (W * D), open_v_ptr + bh * (W * D),
                  sink_k_ptr + bh * (NS * D), sink_v_ptr + bh * (NS * D), num_open, gl.minimum(kv_len, NS), q_ptr,
                  (b * H + h) * QPK, QPK, D, W, NS, QK_SCALE)


@gluon.jit
def _dense_qk(s, kt, qhi, qlo):
    # s [R, 8] += K rows (bf16 [R, 32]) . (q hi + q lo) (B operands of a q^T chunk [32, 8])
    a = gl.convert_layout(kt.to(gl.bfloat16), A_OP)
    return mma_v2(a, qlo, mma_v2(a, qhi, s))


@gluon.jit
def _dense_pv(acc, vt, phi, plo):
    # acc [32, 8] += V^T chunk (bf16 [32, R]) . (p hi + p lo)
    a = gl.convert_layout(vt.to(gl.bfloat16), A_OP)
    return mma_v2(a, plo, mma_v2(a, phi, acc))


@gluon.jit
def hack_gluon_decode_kernel(
        kv_lens_ptr, page_indices_ptr, q_ptr, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr,
        v_min_ptr, open_k_ptr, open_v_ptr, sink_k_ptr, sink_v_ptr, acc_ptr, m_ptr, l_ptr,
        H: gl.constexpr, QPK: gl.constexpr, D: gl.constexpr, P: gl.constexpr, PAGE: gl.constexpr,
        PPS: gl.constexpr, NUM_PAGES: gl.constexpr, NS: gl.constexpr, W: gl.constexpr, SPLITS: gl.constexpr,
        QK_SCALE: gl.constexpr, ASYNC: gl.constexpr, DENSE: gl.constexpr, ROWS: gl.constexpr, OPAD: gl.constexpr):
    # kv_lens i32[S]; page_indices i32[S, PPS]; q f32 | bf16 | f16 [S, H * QPK, D]
    # k_codes u8[N, H, PAGE // 4, D]; k_scale, k_min f16[N, H, PAGE // P, D]
    # v_codes u8[N, H, D, PAGE // 4]; v_scale, v_min f16[N, H, PAGE, 2] (token t, channel group g at 2 t + g)
    # open_k, open_v bf16[S, H, W, D]; sink_k, sink_v bf16[S, H, NS, D] (NS 0: any array, not read)
    # out: acc f32[S, H, ROWS, OPAD, D]; m (natural log units), l f32[S, H, ROWS, OPAD], one row per program written
    # (rows 0 .. SPLITS - 1, and SPLITS with DENSE 3; ROWS may be more: common.split_slots, the rest left as they
    # are); OPAD: QPK rounded up to a power of two (common.q_per_kv_pad), the query heads of a row
    # DENSE 3: one more program per (sequence, kv head), program_id(2) == SPLITS (grid SPLITS + 1), attends to the
    # sinks and the open region's tokens (NS <= 16) and to no sealed group; 2: the first program does, before its
    # groups; 0: the sealed blocks only (the caller attends to the rest)
    # ASYNC < 16: direct loads, bit 1 page ids one group ahead (bit 0 0: the two-stage staging was removed); >= 16:
    # single cp.async buffers (V during QK^T, the next K during PV), META = (ASYNC // 4) % 4 = 1 the metadata staged
    # too (k_scale, v_scale, v_min), page ids always one group ahead
    gl.static_assert(D == 128)
    gl.static_assert(P == 64)
    gl.static_assert(DENSE == 0 or DENSE == 2 or DENSE == 3)
    gl.static_assert(DENSE == 0 or NS <= 16)  # one 16-row sink tile
    gl.static_assert(ROWS >= SPLITS + DENSE // 3)  # a row of partials per program
    gl.static_assert(OPAD >= QPK and OPAD <= 8)
    gl.static_assert(ASYNC >= 16 or ASYNC % 2 == 0)  # no two-stage staging
    gl.static_assert(ASYNC < 16 or (ASYNC // 4) % 4 <= 1)  # META: the K minima are not staged
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    ROW_C: gl.constexpr = gl.SliceLayout(1, mma)
    COL_C: gl.constexpr = gl.SliceLayout(0, mma)
    GPP: gl.constexpr = PAGE // (4 * P)  # packing groups per page

    b = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    kv_len = gl.load(kv_lens_ptr + b)
    after_sinks = gl.minimum(gl.maximum(kv_len - NS, 0), PPS * PAGE)
    num_blocks = (after_sinks // W) * (W // P)
    num_groups = (num_blocks + 3) // 4
    g_lo = split * num_groups // SPLITS
    g_hi = gl.minimum((split + 1) * num_groups // SPLITS, num_groups)  # DENSE 3's program: no groups

    kq = gl.arange(0, 32, layout=gl.SliceLayout(1, LQ))  # physical channel of a chunk
    nq = gl.arange(0, 8, layout=gl.SliceLayout(0, LQ))
    q_rows = q_ptr + ((b * H + h) * QPK + nq)[None, :] * D + kq[:, None]
    qmask = (nq < QPK)[None, :] & (kq < 32)[:, None]
    rk = gl.arange(0, P, layout=gl.SliceLayout(1, LK))  # logical token (row) of a K chunk
    ck = gl.arange(0, 32, layout=gl.SliceLayout(0, LK))  # physical channel
    k_off = _tok(rk)[:, None] * D + ck[None, :]
    rmu = gl.arange(0, 16, layout=gl.SliceLayout(1, LMU))  # bias MMA rows: the group's 4 blocks (>= 4: zero)
    cmu = gl.arange(0, 32, layout=gl.SliceLayout(0, LMU))
    mu_off = rmu[:, None] * D + cmu[None, :]
    rv = gl.arange(0, 32, layout=gl.SliceLayout(1, LV))  # channel of a V chunk
    cv = gl.arange(0, P, layout=gl.SliceLayout(0, LV))  # physical token
    v_off = rv[:, None] * (PAGE // 4) + cv[None, :]
    tok2 = gl.arange(0, P, layout=gl.SliceLayout(1, T2))
    pair2 = gl.arange(0, 2, layout=gl.SliceLayout(0, T2))
    t_off = _tok(tok2)[:, None] * 2 + pair2[None, :]
    rowsC = gl.arange(0, 16, layout=ROW_C)
    chC = gl.arange(0, 32, layout=ROW_C)
    nC = gl.arange(0, 8, layout=COL_C)

    m_i = gl.full([8], float("-inf"), gl.float32, layout=COL_C)
    l_i = gl.zeros([8], gl.float32, layout=COL_C)
    nu0_i = gl.zeros([8], gl.float32, layout=COL_C)
    nu1_i = gl.zeros([8], gl.float32, layout=COL_C)
    # O^T in 4 chunks of 32 channels, in units of 2**-24
    acc0 = gl.zeros([32, 8], gl.float32, layout=mma)
    acc1 = gl.zeros([32, 8], gl.float32, layout=mma)
    acc2 = gl.zeros([32, 8], gl.float32, layout=mma)
    acc3 = gl.zeros([32, 8], gl.float32, layout=mma)
    g_full = gl.minimum(g_hi, num_blocks // 4)  # groups of 4 sealed blocks
    last = gl.maximum(g_hi - 1, 0)
    if DENSE != 0:  # the sinks and open region first, while no loop state is live; the state to the loop's units
        # DENSE 2: split 0 (the fewest groups where they do not divide evenly); 3: the program after the splits
        if split == SPLITS * (DENSE // 3):
            m_i, l_i, acc0, acc1, acc2, acc3 = _dense_part(m_i, l_i, acc0, acc1, acc2, acc3, b, h, kv_len,
                                                           after_sinks, q_ptr, open_k_ptr, open_v_ptr, sink_k_ptr,
                                                           sink_v_ptr, H, QPK, D, W, NS, QK_SCALE)
            u = 2.0 ** -24
            acc0 = acc0 * u
            acc1 = acc1 * u
            acc2 = acc2 * u
            acc3 = acc3 * u
    # page ids: one group ahead (bit 1 of ASYNC), so that no group's first loads wait on its page id's load
    pid_cur = _pid(page_indices_ptr, b, gl.minimum(g_lo, last), PPS, GPP, NUM_PAGES)
    if ASYNC >= 16:  # single buffers, each group's V copied during its QK^T, the next group's K during its PV
        META: gl.constexpr = (ASYNC // 4) % 4  # 1: k_scale, v_scale, v_min staged too
        ksm, vsm, ksc, vsc, vmn = _stages(1, P, D, META)
        _copy_k(ksm.index(0), ksc.index(0), k_codes_ptr, k_scale_ptr, pid_cur, g_lo % GPP, h, g_lo < g_full, H, D, P,
                PAGE, META)
        async_copy.commit_group()
        for grp in range(g_lo, g_full):
            pid = pid_cur
            pid_cur = _pid(page_indices_ptr, b, gl.minimum(grp + 1, last), PPS, GPP, NUM_PAGES)
            m_i, l_i, nu0_i, nu1_i, acc0, acc1, acc2, acc3 = _group(
                m_i, l_i, nu0_i, nu1_i, acc0, acc1, acc2, acc3, grp, pid, ksm.index(0), vsm.index(0),
                ksc.index(0), vsc.index(0), vmn.index(0), num_blocks, h, q_rows, qmask,
                k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr, v_min_ptr, kq, k_off, rmu, cmu,
                mu_off, v_off, t_off, rowsC, pid_cur, grp + 1 < g_full, H, D, P, PAGE, QK_SCALE, False, True, META)
        async_copy.wait_group(0)
    else:
        for grp in range(g_lo, g_full):
            pid, pid_cur = _group_pid(pid_cur, page_indices_ptr, b, grp, last, (ASYNC // 2) % 2 == 1, PPS, GPP,
                                      NUM_PAGES)
            m_i, l_i, nu0_i, nu1_i, acc0, acc1, acc2, acc3 = _group(
                m_i, l_i, nu0_i, nu1_i, acc0, acc1, acc2, acc3, grp, pid, 0, 0, 0, 0, 0, num_blocks, h, q_rows,
                qmask, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr, v_min_ptr, kq, k_off, rmu,
                cmu, mu_off, v_off, t_off, rowsC, 0, False, H, D, P, PAGE, QK_SCALE, False, False, 0)
    if g_hi > g_lo:  # the last group again if it is partial: masked
        if g_hi * 4 > num_blocks:
            pid = _pid(page_indices_ptr, b, last, PPS, GPP, NUM_PAGES)
            m_i, l_i, nu0_i, nu1_i, acc0, acc1, acc2, acc3 = _group(
                m_i, l_i, nu0_i, nu1_i, acc0, acc1, acc2, acc3, g_hi - 1, pid, 0, 0, 0, 0, 0, num_blocks, h, q_rows,
                qmask, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr, v_min_ptr, kq, k_off, rmu, cmu,
                mu_off, v_off, t_off, rowsC, 0, False, H, D, P, PAGE, QK_SCALE, True, False, 0)

    w = 2.0 ** 24  # the accumulator in real units from here
    acc0 = acc0 * w + nu0_i[None, :]
    acc1 = acc1 * w + nu0_i[None, :]
    acc2 = acc2 * w + nu1_i[None, :]
    acc3 = acc3 * w + nu1_i[None, :]
    out_row = ((b * H + h) * ROWS + gl.program_id(2)) * OPAD + nC  # [8]; nC >= OPAD not stored
    gl.store(m_ptr + out_row, m_i * 0.6931471805599453, mask=nC < OPAD)  # base 2 -> natural log units
    gl.store(l_ptr + out_row, l_i, mask=nC < OPAD)
    optr = acc_ptr + out_row[None, :] * D + chC[:, None]
    omask = (nC < OPAD)[None, :] & (chC < 32)[:, None]
    gl.store(optr, acc0, mask=omask)
    gl.store(optr + 32, acc1, mask=omask)
    gl.store(optr + 64, acc2, mask=omask)
    gl.store(optr + 96, acc3, mask=omask)
