"""The @triton.jit body of pallas_kernels.triton_decode_attention (that module's docstring says what
it computes, the shapes and the caveats). Kept apart so the host-side module imports without Triton.

Notation in the shape comments: GP = q_per_kv_pad (query heads of one kv head, padded to a power of
two), D = head_dim, P = partition_size, PC = min(P, D) channels per channel group, 4 = the planes of a
packing group (its 4 blocks), T = NS_PAD padded sink rows.
"""
import triton
import triton.language as tl

# Plane j of a packed byte (bits 2j..2j+1) as the exact f16 value code * 4**j, 4 bytes per call ($2):
# AND the plane's bits, spread bytes 0,1 (2,3) into the low bytes of two half words under the exponent
# byte 0x64 (PRMT: f16 1024 + code * 4**j), subtract 1024 (HSUB2): 5 instructions per 4 codes, no
# integer-to-float convert. The plane is the warp's index (tid.x / 32): the 3-D dots' mma layout puts
# warp j on batch index j (warpsPerCTA [4, 1, 1], see the TTGIR), so the mask costs one hoisted register
# and the unpack's only operand is the loaded tile (broadcast over the planes), which lets Triton copy
# the u8 tile once into shared memory, load it from there straight into (a broadcast of) the MMA operand
# layout and unpack in registers (no f16 round trip through shared memory, no 4x copies).
_UNPACK_ASM = tl.constexpr(
    "{ .reg .b32 t, k, z, w, m; mov.u32 w, %tid.x; shr.u32 w, w, 5; shl.b32 w, w, 1; "
    "mov.b32 m, 0x03030303; shl.b32 m, m, w; and.b32 t, $2, m; mov.b32 k, 0x64646464; "
    "mov.b32 z, 0x64006400; prmt.b32 $0, t, k, 0x4140; prmt.b32 $1, t, k, 0x4342; "
    "sub.f16x2 $0, $0, z; sub.f16x2 $1, $1, z; }")


@triton.jit
def _planes(x, USE_ASM: tl.constexpr):
    # x u8[4, A, B] packed bytes (one tile broadcast over the planes) -> f16[4, A, B],
    # [j] = code of plane j * 4**j (exact). USE_ASM needs num_warps == 4 (plane = warp, above).
    if USE_ASM:
        return tl.inline_asm_elementwise(_UNPACK_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        j = tl.arange(0, 4)
        return (x & (3 << (2 * j)).to(tl.uint8)[:, None, None]).to(tl.float16)


@triton.jit
def _qk(q, k_codes_ptr, k_scale_ptr, k_min_ptr, ph, gi, slot, valid, CG: tl.constexpr, PC: tl.constexpr,
        P: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, USE_ASM: tl.constexpr):
    # Channel group CG of the logits: (4**j dot(codes_K, f16(q * sigma)) [4, P, GP], q . mu [4, GP]) for
    # q f32[PC, GP] (the group's channels). Per channel group, so each warp's A operand is [P, PC].
    c = tl.arange(0, PC)
    r = tl.arange(0, P)
    j = tl.arange(0, 4)
    kt = tl.load(k_codes_ptr + ph * (PAGE_SIZE // 4 * HEAD_DIM) + (gi * P + r)[:, None] * HEAD_DIM
                 + CG * PC + c[None, :])  # u8[P, PC]
    kt = tl.broadcast_to(kt[None, :, :], (4, P, PC))
    meta = (ph * (PAGE_SIZE // P) + slot[:, None]) * HEAD_DIM + CG * PC + c[None, :]  # [4, PC]
    sigma = tl.load(k_scale_ptr + meta, mask=valid[:, None], other=0.0).to(tl.float32)  # [4, PC]
    mu = tl.load(k_min_ptr + meta, mask=valid[:, None], other=0.0).to(tl.float32)  # [4, PC]
    a = (q[None, :, :] * sigma[:, :, None]).to(tl.float16)  # [4, PC, GP] scale-folded query
    return tl.dot(_planes(kt, USE_ASM), a, out_dtype=tl.float32), tl.sum(q[None, :, :] * mu[:, :, None], axis=1)


@triton.jit
def _pv(acc, alpha, pr, plane_w, valid, v_codes_ptr, v_scale_ptr, v_min_ptr, ph, gi, slot,
        CG: tl.constexpr, PC: tl.constexpr, NP: tl.constexpr, P: tl.constexpr, PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, USE_ASM: tl.constexpr):
    # One channel group CG of the PV update, transposed: acc f32[4, PC, GP] rescaled by alpha [4, GP],
    # plus 4**-j dot(codes_V, f16(pr * tau)) + sum_r pr_r nu_r.
    c = tl.arange(0, PC)
    r = tl.arange(0, P)
    # token-major V codes: byte [page, h, channel, gi P + r]
    vt = tl.load(v_codes_ptr + ph * (HEAD_DIM * PAGE_SIZE // 4) + (CG * PC + c)[:, None] * (PAGE_SIZE // 4)
                 + gi * P + r[None, :])  # u8[PC, P]
    vt = tl.broadcast_to(vt[None, :, :], (4, PC, P))
    tok = (ph * PAGE_SIZE + slot[:, None] * P + r[None, :]) * NP + CG  # [4, P] per-token metadata offsets
    tau = tl.load(v_scale_ptr + tok, mask=valid[:, None], other=0.0).to(tl.float32)  # [4, P]
    nu = tl.load(v_min_ptr + tok, mask=valid[:, None], other=0.0).to(tl.float32)  # [4, P]
    w = (pr * tau[:, :, None]).to(tl.float16)  # [4, P, GP] scale-folded weights
    o = tl.dot(_planes(vt, USE_ASM), w, out_dtype=tl.float32)  # [4, PC, GP]
    corr = tl.sum(pr * nu[:, :, None], axis=1)  # [4, GP]
    return acc * alpha[:, None, :] + o * plane_w[:, None, None] + corr[:, None, :]


@triton.jit
def _merge_planes(m, l, acc0, acc1):
    # The 4 plane streams of a program -> one state: m, l f32[GP], acc0/acc1 f32[PC, GP].
    mm = tl.max(m, axis=0)  # [GP]
    sc = tl.exp2(m - tl.where(mm == float("-inf"), 0.0, mm)[None, :])  # [4, GP]
    return (mm, tl.sum(l * sc, axis=0), tl.sum(acc0 * sc[:, None, :], axis=0),
            tl.sum(acc1 * sc[:, None, :], axis=0))


@triton.jit
def _residual_pv(p, v_ptr, row0, rows, n, CG: tl.constexpr, PC: tl.constexpr, HEAD_DIM: tl.constexpr):
    # bf16 V rows [row0, row0 + n) (masked) of channel group CG, transposed, @ p f32[n_rows, GP]
    # -> f32[PC, GP]
    c = tl.arange(0, PC)
    v = tl.load(v_ptr + (row0 + rows)[None, :] * HEAD_DIM + (CG * PC + c)[:, None], mask=(rows < n)[None, :],
                other=0.0).to(tl.float32)  # [PC, n_rows]
    return tl.dot(v, p, input_precision="ieee")


@triton.jit
def _residual_qk(q0, q1, k_ptr, row0, rows, n, PC: tl.constexpr, NP: tl.constexpr, HEAD_DIM: tl.constexpr):
    # bf16 K rows [row0, row0 + n) (masked) @ q (channel groups q0, q1 f32[PC, GP]) -> f32[n_rows, GP]
    c = tl.arange(0, PC)
    ptrs = k_ptr + (row0 + rows)[:, None] * HEAD_DIM + c[None, :]
    out = tl.dot(tl.load(ptrs, mask=(rows < n)[:, None], other=0.0).to(tl.float32), q0, input_precision="ieee")
    if NP == 2:
        out += tl.dot(tl.load(ptrs + PC, mask=(rows < n)[:, None], other=0.0).to(tl.float32), q1,
                      input_precision="ieee")
    return out


@triton.jit
def hack_triton_decode_kernel(
        kv_lens_ptr, page_indices_ptr, q_ptr, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr,
        v_min_ptr, open_k_ptr, open_v_ptr, sink_k_ptr, sink_v_ptr, acc_ptr, m_ptr, l_ptr,
        NUM_KV_HEADS: tl.constexpr, Q_PER_KV: tl.constexpr, Q_PER_KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        P: tl.constexpr, PC: tl.constexpr, NP: tl.constexpr, PAGE_SIZE: tl.constexpr,
        PAGES_PER_SEQ: tl.constexpr, NUM_PAGES: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr, QK_SCALE: tl.constexpr, USE_ASM: tl.constexpr):
    # kv_lens_ptr i32[S]; page_indices_ptr i32[S, PAGES_PER_SEQ]; q_ptr float[S, Hq, D]
    # k_codes_ptr u8[N, H, PAGE_SIZE // 4, D]; k_scale_ptr, k_min_ptr f16[N, H, PAGE_SIZE // P, D]
    # v_codes_ptr u8[N, H, D, PAGE_SIZE // 4]; v_scale_ptr, v_min_ptr f16[N, H, PAGE_SIZE, NP]
    # open_k_ptr, open_v_ptr bf16[S, H, P, D]; sink_k_ptr, sink_v_ptr bf16[S, H, NS, D]
    # out: acc_ptr f32[S, H, NUM_SPLITS + 1, GP, D]; m_ptr (base 2), l_ptr f32[S, H, NUM_SPLITS + 1, GP]
    # Products are transposed (tokens / channels as M, query heads as N): the codes are the A operand
    # in their stored orientation and the softmax weights [P, GP] are PV's B operand as they come.
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, Q_PER_KV_PAD)
    r = tl.arange(0, P)
    j = tl.arange(0, 4)
    kv_len = tl.load(kv_lens_ptr + b)
    after_sinks = tl.minimum(tl.maximum(kv_len - NS, 0), PAGES_PER_SEQ * PAGE_SIZE)  # clipped to capacity
    num_blocks = after_sinks // P
    num_open = after_sinks % P
    # q^T * sm_scale * log2(e) per channel group: logits in base 2 (exp2); columns g >= Q_PER_KV are 0
    c = tl.arange(0, PC)
    q_rows = q_ptr + ((b * NUM_KV_HEADS + h) * Q_PER_KV + g)[None, :] * HEAD_DIM
    q0 = tl.load(q_rows + c[:, None], mask=(g < Q_PER_KV)[None, :], other=0.0).to(tl.float32) * QK_SCALE  # [PC, GP]
    q1 = q0  # channel group 1 (NP == 2), else unused
    if NP == 2:
        q1 = tl.load(q_rows + PC + c[:, None], mask=(g < Q_PER_KV)[None, :], other=0.0).to(tl.float32) * QK_SCALE

    if split < NUM_SPLITS:
        num_packing_groups = (num_blocks + 3) // 4
        g_lo = split * num_packing_groups // NUM_SPLITS
        g_hi = (split + 1) * num_packing_groups // NUM_SPLITS
        plane_w = tl.exp2(-2.0 * j.to(tl.float32))  # [4] 4**-j, undoes the unpack's 4**j
        m_i = tl.full([4, Q_PER_KV_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([4, Q_PER_KV_PAD], tl.float32)
        acc0 = tl.zeros([4, PC, Q_PER_KV_PAD], tl.float32)
        acc1 = tl.zeros([4, PC, Q_PER_KV_PAD], tl.float32)  # channel group 1 (NP == 2), else unused
        for packing_group in range(g_lo, g_hi):
            gi = packing_group % (PAGE_SIZE // (4 * P))  # packing group in its page
            pid = tl.load(page_indices_ptr + b * PAGES_PER_SEQ + packing_group // (PAGE_SIZE // (4 * P)))
            pid = tl.where((pid >= 0) & (pid < NUM_PAGES), pid, 0)  # bad ids read the null page
            ph = pid.to(tl.int64) * NUM_KV_HEADS + h  # (page, kv head) index
            slot = gi * 4 + j  # [4] block slots in the page
            valid = packing_group * 4 + j < num_blocks  # [4]
            s, qmu = _qk(q0, k_codes_ptr, k_scale_ptr, k_min_ptr, ph, gi, slot, valid, 0, PC, P, PAGE_SIZE,
                         HEAD_DIM, USE_ASM)  # [4, P, GP], [4, GP]
            if NP == 2:
                s1, qmu1 = _qk(q1, k_codes_ptr, k_scale_ptr, k_min_ptr, ph, gi, slot, valid, 1, PC, P, PAGE_SIZE,
                               HEAD_DIM, USE_ASM)
                s += s1
                qmu += qmu1
            s = s * plane_w[:, None, None] + qmu[:, None, :]
            s = tl.where(valid[:, None, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [4, GP]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)  # [4, GP]
            pr = tl.exp2(s - m_safe[:, None, :])  # [4, P, GP]
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            m_i = m_new
            acc0 = _pv(acc0, alpha, pr, plane_w, valid, v_codes_ptr, v_scale_ptr, v_min_ptr, ph, gi, slot,
                       0, PC, NP, P, PAGE_SIZE, HEAD_DIM, USE_ASM)
            if NP == 2:
                acc1 = _pv(acc1, alpha, pr, plane_w, valid, v_codes_ptr, v_scale_ptr, v_min_ptr, ph, gi, slot,
                           1, PC, NP, P, PAGE_SIZE, HEAD_DIM, USE_ASM)
        m_o, l_o, acc0_o, acc1_o = _merge_planes(m_i, l_i, acc0, acc1)
    else:
        # The last program: sinks and the open block, float32 attention on their 16-bit K/V.
        seq_head = b * NUM_KV_HEADS + h
        so = tl.where((r < num_open)[:, None], _residual_qk(q0, q1, open_k_ptr, seq_head * P, r, num_open, PC, NP,
                                                            HEAD_DIM), float("-inf"))  # [P, GP]
        m_o = tl.max(so, axis=0)
        if NS > 0:
            t = tl.arange(0, NS_PAD)
            n_sinks = tl.minimum(kv_len, NS)
            ss = tl.where((t < n_sinks)[:, None], _residual_qk(q0, q1, sink_k_ptr, seq_head * NS, t, n_sinks, PC, NP,
                                                               HEAD_DIM), float("-inf"))  # [T, GP]
            m_o = tl.maximum(m_o, tl.max(ss, axis=0))
        m_safe = tl.where(m_o == float("-inf"), 0.0, m_o)
        po = tl.exp2(so - m_safe[None, :])  # [P, GP]
        l_o = tl.sum(po, axis=0)
        acc0_o = _residual_pv(po, open_v_ptr, seq_head * P, r, num_open, 0, PC, HEAD_DIM)
        acc1_o = acc0_o
        if NP == 2:
            acc1_o = _residual_pv(po, open_v_ptr, seq_head * P, r, num_open, 1, PC, HEAD_DIM)
        if NS > 0:
            ps = tl.exp2(ss - m_safe[None, :])  # [T, GP]
            l_o += tl.sum(ps, axis=0)
            acc0_o += _residual_pv(ps, sink_v_ptr, seq_head * NS, t, n_sinks, 0, PC, HEAD_DIM)
            if NP == 2:
                acc1_o += _residual_pv(ps, sink_v_ptr, seq_head * NS, t, n_sinks, 1, PC, HEAD_DIM)

    out_row = ((b * NUM_KV_HEADS + h) * (NUM_SPLITS + 1) + split) * Q_PER_KV_PAD + g  # [GP]
    tl.store(m_ptr + out_row, m_o)
    tl.store(l_ptr + out_row, l_o)
    tl.store(acc_ptr + out_row[None, :] * HEAD_DIM + c[:, None], acc0_o)
    if NP == 2:
        tl.store(acc_ptr + out_row[None, :] * HEAD_DIM + PC + c[:, None], acc1_o)
