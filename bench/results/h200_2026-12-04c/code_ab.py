"""Call 3: the decode kernel's source variants timed through XLA in one process (harn_tmp/da_*.py: copies of
pallas_kernels/decode_attention.py; base = the committed code, v1 = tau / nu broadcast per channel group,
v16 = v1 + the nu tile feeding the PV operand), each with its default_config (register cap 168), beside bf16."""
import importlib.util, json, math, sys
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import bench_hack_decode as bh

mods = {}
for tag in sys.argv[2:]:
    spec = importlib.util.spec_from_file_location(f"pallas_kernels.da_{tag}", f"harn_tmp/da_{tag}.py")
    mods[tag] = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mods[tag])
out = open(sys.argv[1], "a")
for shape in ("b8_32k", "b1_32k", "b1_128k", "b8_128k"):
    batch, kv_len = bh.SHAPES[shape]
    nbytes = bh.cache_bytes(batch, kv_len)
    n_copies = max(1, min(8, math.ceil((256 << 20) / nbytes)))
    c, table, lens, ppc = bh.make_inputs(batch, kv_len, n_copies)
    order = list(mods) + list(mods)[::-1]  # each twice, in and against the order: drift shows as a spread
    for tag in order:
        m = mods[tag]
        cfg = m.default_config(batch=batch, num_kv_heads=bh.HKV, pages_per_seq=kv_len // bh.PAGE, page_size=bh.PAGE,
                               partition_size=bh.P, dot_dtype="folded_f16")
        us, comp, n = bh.time_variant(m.hack_decode_attention, cfg, c, table, lens, ppc, n_copies, batch, 3, 40.0,
                                      calls_per_iter=8)
        row = dict(shape=shape, variant=tag, us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), config=str(cfg))
        print(json.dumps(row), flush=True); out.write(json.dumps(row) + "\n"); out.flush()
    del c
    nb = batch * bh.HKV * kv_len * 2 * bh.D * 2
    nc = max(1, min(8, math.ceil((256 << 20) / nb)))
    k, v, bt, bl, bppc = bh.bf16_inputs(batch, kv_len, nc)
    us, comp, n = bh.time_variant("bf16paged", None, dict(k=k, v=v), bt, bl, bppc, nc, batch, 3, 40.0, calls_per_iter=8)
    row = dict(shape=shape, variant="bf16", us=round(us, 2), gbps=round(nb / us / 1e3, 1))
    print(json.dumps(row), flush=True); out.write(json.dumps(row) + "\n"); out.flush()
    del k, v
