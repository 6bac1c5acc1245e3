"""The @triton.jit body of pallas_kernels.triton_decode_attention (that module's docstring says what
it computes, the shapes and the caveats). Kept apart so the host-side module imports without Triton.

Notation in the shape comments: GP = group_pad (query heads of one kv head, padded to a power of
two), D = head_dim, P = partition_size, PC = min(P, D) channels per channel group, 4 = the planes of a
packing group (its 4 blocks), T = NS_PAD padded sink rows.
"""
import triton
import triton.language as tl

# Plane j of a packed byte (bits 2j..2j+1) as the exact f16 value code * 4**j, 4 bytes per call:
# and the plane's bits, spread bytes 0,1 (2,3) into the low bytes of two half words with exponent
# byte 0x64 above them (PRMT: 1024 + code * 4**j in f16), then subtract 1024 (HSUB2). 5 instructions
# per 4 codes, no integer-to-float convert.
_ASM = "{ .reg .b32 t, k, z; and.b32 t, $2, %s; mov.b32 k, 0x64646464; mov.b32 z, 0x64006400; " \
       "prmt.b32 $0, t, k, 0x4140; prmt.b32 $1, t, k, 0x4342; sub.f16x2 $0, $0, z; sub.f16x2 $1, $1, z; }"
_ASM0 = tl.constexpr(_ASM % "0x03030303")
_ASM1 = tl.constexpr(_ASM % "0x0C0C0C0C")
_ASM2 = tl.constexpr(_ASM % "0x30303030")
_ASM3 = tl.constexpr(_ASM % "0xC0C0C0C0")
_MASK0 = tl.constexpr(0x03)
_MASK1 = tl.constexpr(0x0C)
_MASK2 = tl.constexpr(0x30)
_MASK3 = tl.constexpr(0xC0)


@triton.jit
def _plane(x, asm: tl.constexpr, mask: tl.constexpr, USE_ASM: tl.constexpr):
    # x u8[...] -> f16[...]: (x & mask), i.e. code_j * 4**j
    if USE_ASM:
        return tl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return (x & mask).to(tl.float16)


@triton.jit
def _planes(x, USE_ASM: tl.constexpr):
    # x u8[A, B] packed bytes -> f16[4, A, B], [j] = code of plane j * 4**j
    p01 = tl.join(_plane(x, _ASM0, _MASK0, USE_ASM), _plane(x, _ASM1, _MASK1, USE_ASM))  # [A, B, 2]
    p23 = tl.join(_plane(x, _ASM2, _MASK2, USE_ASM), _plane(x, _ASM3, _MASK3, USE_ASM))  # [A, B, 2]
    p = tl.permute(tl.join(p01, p23), (3, 2, 0, 1))  # [2, 2, A, B]: [o, i] = plane 2 o + i
    return tl.reshape(p, (4, x.shape[0], x.shape[1]))


@triton.jit
def _pv(acc, alpha, pr, plane_w, valid, v_codes_ptr, v_scale_ptr, v_min_ptr, ph, gi, slot,
        CG: tl.constexpr, PC: tl.constexpr, NP: tl.constexpr, P: tl.constexpr, PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, USE_ASM: tl.constexpr):
    # One channel group CG of the PV update: acc f32[4, GP, PC] rescaled by alpha [4, GP], plus
    # 4**-j dot(f16(pr * tau), codes_V) + sum_r pr_r nu_r.
    c = tl.arange(0, PC)
    r = tl.arange(0, P)
    # token-major V codes: byte [page, h, channel, gi P + r]
    vt = tl.load(v_codes_ptr + ph * (HEAD_DIM * PAGE_SIZE // 4) + (CG * PC + c)[:, None] * (PAGE_SIZE // 4)
                 + gi * P + r[None, :])  # u8[PC, P]
    vp = tl.permute(_planes(vt, USE_ASM), (0, 2, 1))  # f16[4, P, PC]
    tok = (ph * PAGE_SIZE + slot[:, None] * P + r[None, :]) * NP + CG  # [4, P] per-token metadata offsets
    tau = tl.load(v_scale_ptr + tok, mask=valid[:, None], other=0.0).to(tl.float32)  # [4, P]
    nu = tl.load(v_min_ptr + tok, mask=valid[:, None], other=0.0).to(tl.float32)  # [4, P]
    w = (pr * tau[:, None, :]).to(tl.float16)  # [4, GP, P]
    o = tl.dot(w, vp, out_dtype=tl.float32)  # [4, GP, PC]
    corr = tl.sum(pr * nu[:, None, :], axis=2)  # [4, GP]
    return acc * alpha[:, :, None] + o * plane_w[:, None, None] + corr[:, :, None]


@triton.jit
def _merge_planes(m, l, acc0, acc1):
    # The 4 plane streams of a program -> one state: m, l f32[GP], acc0/acc1 f32[GP, PC].
    mm = tl.max(m, axis=0)  # [GP]
    sc = tl.exp2(m - tl.where(mm == float("-inf"), 0.0, mm)[None, :])  # [4, GP]
    return (mm, tl.sum(l * sc, axis=0), tl.sum(acc0 * sc[:, :, None], axis=0),
            tl.sum(acc1 * sc[:, :, None], axis=0))


@triton.jit
def _residual_pv(p, v_ptr, row0, rows, n, CG: tl.constexpr, PC: tl.constexpr, HEAD_DIM: tl.constexpr):
    # p f32[GP, n_rows] @ the bf16 V rows [row0, row0 + n) (masked) of channel group CG -> f32[GP, PC]
    c = tl.arange(0, PC)
    v = tl.load(v_ptr + (row0 + rows)[:, None] * HEAD_DIM + (CG * PC + c)[None, :], mask=(rows < n)[:, None],
                other=0.0).to(tl.float32)  # [n_rows, PC]
    return tl.dot(p, v, input_precision="ieee")


@triton.jit
def hack_triton_decode_kernel(
        kv_lens_ptr, page_indices_ptr, q_ptr, k_codes_ptr, k_scale_ptr, k_min_ptr, v_codes_ptr, v_scale_ptr,
        v_min_ptr, open_k_ptr, open_v_ptr, sink_k_ptr, sink_v_ptr, acc_ptr, m_ptr, l_ptr,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        P: tl.constexpr, PC: tl.constexpr, NP: tl.constexpr, PAGE_SIZE: tl.constexpr,
        PAGES_PER_SEQ: tl.constexpr, NUM_PAGES: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr, QK_SCALE: tl.constexpr, USE_ASM: tl.constexpr):
    # kv_lens_ptr i32[S]; page_indices_ptr i32[S, PAGES_PER_SEQ]; q_ptr float[S, Hq, D]
    # k_codes_ptr u8[N, H, PAGE_SIZE // 4, D]; k_scale_ptr, k_min_ptr f16[N, H, PAGE_SIZE // P, D]
    # v_codes_ptr u8[N, H, D, PAGE_SIZE // 4]; v_scale_ptr, v_min_ptr f16[N, H, PAGE_SIZE, NP]
    # open_k_ptr, open_v_ptr bf16[S, H, P, D]; sink_k_ptr, sink_v_ptr bf16[S, H, NS, D]
    # out: acc_ptr f32[S, H, NUM_SPLITS + 1, GP, D]; m_ptr (base 2), l_ptr f32[S, H, NUM_SPLITS + 1, GP]
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    r = tl.arange(0, P)
    j = tl.arange(0, 4)
    kv_len = tl.load(kv_lens_ptr + b)
    after_sinks = tl.minimum(tl.maximum(kv_len - NS, 0), PAGES_PER_SEQ * PAGE_SIZE)  # clipped to capacity
    num_blocks = after_sinks // P
    num_open = after_sinks % P
    # q * sm_scale * log2(e): logits in base 2 (exp2), rows g >= GROUP are 0
    q = tl.load(q_ptr + ((b * NUM_KV_HEADS + h) * GROUP + g)[:, None] * HEAD_DIM + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0).to(tl.float32) * QK_SCALE  # [GP, D]

    if split < NUM_SPLITS:
        n_groups = (num_blocks + 3) // 4
        g_lo = split * n_groups // NUM_SPLITS
        g_hi = (split + 1) * n_groups // NUM_SPLITS
        plane_w = tl.exp2(-2.0 * j.to(tl.float32))  # [4] 4**-j, undoes the unpack's 4**j
        m_i = tl.full([4, GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([4, GROUP_PAD], tl.float32)
        acc0 = tl.zeros([4, GROUP_PAD, PC], tl.float32)
        acc1 = tl.zeros([4, GROUP_PAD, PC], tl.float32)  # channel group 1 (NP == 2), else unused
        for tg in range(g_lo, g_hi):
            gi = tg % (PAGE_SIZE // (4 * P))  # packing group in its page
            pid = tl.load(page_indices_ptr + b * PAGES_PER_SEQ + tg // (PAGE_SIZE // (4 * P)))
            pid = tl.where((pid >= 0) & (pid < NUM_PAGES), pid, 0)  # bad ids read the null page
            ph = pid.to(tl.int64) * NUM_KV_HEADS + h  # (page, kv head) index
            slot = gi * 4 + j  # [4] block slots in the page
            valid = tg * 4 + j < num_blocks  # [4]
            # K codes read transposed: kt[c, r] = byte of in-group token r, channel c
            kt = tl.load(k_codes_ptr + ph * (PAGE_SIZE // 4 * HEAD_DIM) + (gi * P + r)[None, :] * HEAD_DIM
                         + d[:, None])  # u8[D, P]
            meta = (ph * (PAGE_SIZE // P) + slot[:, None]) * HEAD_DIM + d[None, :]  # [4, D]
            sigma = tl.load(k_scale_ptr + meta, mask=valid[:, None], other=0.0).to(tl.float32)  # [4, D]
            mu = tl.load(k_min_ptr + meta, mask=valid[:, None], other=0.0).to(tl.float32)  # [4, D]
            a = (q[None, :, :] * sigma[:, None, :]).to(tl.float16)  # [4, GP, D] scale-folded query
            qmu = tl.sum(q[None, :, :] * mu[:, None, :], axis=2)  # [4, GP]
            s = tl.dot(a, _planes(kt, USE_ASM), out_dtype=tl.float32)  # [4, GP, P] = 4**j a . codes
            s = s * plane_w[:, None, None] + qmu[:, :, None]
            s = tl.where(valid[:, None, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=2))  # [4, GP]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)  # [4, GP]
            pr = tl.exp2(s - m_safe[:, :, None])  # [4, GP, P]
            l_i = l_i * alpha + tl.sum(pr, axis=2)
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
        ok = tl.load(open_k_ptr + (seq_head * P + r)[:, None] * HEAD_DIM + d[None, :],
                     mask=(r < num_open)[:, None], other=0.0).to(tl.float32)  # [P, D]
        so = tl.where((r < num_open)[None, :], tl.dot(q, tl.trans(ok), input_precision="ieee"),
                      float("-inf"))  # [GP, P]
        m_o = tl.max(so, axis=1)
        if NS > 0:
            t = tl.arange(0, NS_PAD)
            n_sinks = tl.minimum(kv_len, NS)
            sk = tl.load(sink_k_ptr + (seq_head * NS + t)[:, None] * HEAD_DIM + d[None, :],
                         mask=(t < n_sinks)[:, None], other=0.0).to(tl.float32)  # [T, D]
            ss = tl.where((t < n_sinks)[None, :], tl.dot(q, tl.trans(sk), input_precision="ieee"),
                          float("-inf"))  # [GP, T]
            m_o = tl.maximum(m_o, tl.max(ss, axis=1))
        m_safe = tl.where(m_o == float("-inf"), 0.0, m_o)
        po = tl.exp2(so - m_safe[:, None])  # [GP, P]
        l_o = tl.sum(po, axis=1)
        acc0_o = _residual_pv(po, open_v_ptr, seq_head * P, r, num_open, 0, PC, HEAD_DIM)
        acc1_o = acc0_o
        if NP == 2:
            acc1_o = _residual_pv(po, open_v_ptr, seq_head * P, r, num_open, 1, PC, HEAD_DIM)
        if NS > 0:
            ps = tl.exp2(ss - m_safe[:, None])  # [GP, T]
            l_o += tl.sum(ps, axis=1)
            acc0_o += _residual_pv(ps, sink_v_ptr, seq_head * NS, t, n_sinks, 0, PC, HEAD_DIM)
            if NP == 2:
                acc1_o += _residual_pv(ps, sink_v_ptr, seq_head * NS, t, n_sinks, 1, PC, HEAD_DIM)

    out_row = ((b * NUM_KV_HEADS + h) * (NUM_SPLITS + 1) + split) * GROUP_PAD + g  # [GP]
    tl.store(m_ptr + out_row, m_o)
    tl.store(l_ptr + out_row, l_o)
    c = tl.arange(0, PC)
    tl.store(acc_ptr + out_row[:, None] * HEAD_DIM + c[None, :], acc0_o)
    if NP == 2:
        tl.store(acc_ptr + out_row[:, None] * HEAD_DIM + PC + c[None, :], acc1_o)
