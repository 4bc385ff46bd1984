"""Decision 0013's probe: bf16 layer shapes of the default model through oneDNN's prepacked
linear, kiln's row-major dot-product kernel and a VNNI-packed kernel (vnni_probe.cpp) with 1..4
blocks per panel, at the given rows:copies (weights cycled through `copies` layers so they
come from memory). usage: python benchmarks/experiments/vnni_probe.py 1:30 16:8 64:4 512:4
"""
import time, torch, sys
from torch.utils.cpp_extension import load
vn = load("vn", [str(__import__("pathlib").Path(__file__).with_name("vnni_probe.cpp"))], extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
from kiln.kernels import cpu
cpu.load()
torch.set_num_threads(2)
shapes=[(960,576),(576,576),(3072,576),(576,1536)]   # all divisible by 48
for M, L in [(int(a),int(b)) for a,b in (t.split(":") for t in sys.argv[1:])]:
    W={s:[torch.randn(*s).to(torch.bfloat16) for _ in range(L)] for s in shapes}
    P={s:[torch.ops.mkldnn._reorder_linear_weight(w,1) for w in W[s]] for s in shapes}
    V={s:[vn.pack_vnni(w) for w in W[s]] for s in shapes}
    x={s:torch.randn(M,s[1]).to(torch.bfloat16) for s in shapes}
    for s in shapes:
        ref=x[s].float()@W[s][0].float().T
        for f in (vn.mm1,vn.mm3):
            got=f(x[s],V[s][0]); assert torch.allclose(got,ref,rtol=1e-3,atol=1e-2),(s,(got-ref).abs().max())
    c={'onednn':lambda s,l: torch.ops.mkldnn._linear_pointwise(x[s],P[s][l],None,"none",[],""),
       'kiln_dp':lambda s,l: torch.ops.kiln.bf16_gemm_f32(x[s],W[s][l])}
    for nv,f in ((1,vn.mm1),(2,vn.mm2),(3,vn.mm3),(4,vn.mm4)):
        c[f'vnni{nv}']=(lambda f: lambda s,l: f(x[s],V[s][l]))(f)
    r={k:[] for k in c}
    for rep in range(7):
        for k,f in c.items():
            t=time.perf_counter()
            for l in range(L):
                for s in shapes: f(s,l)
            r[k].append(time.perf_counter()-t)
    fl=sum(2*M*s[0]*s[1] for s in shapes)*L; by=sum(2*s[0]*s[1] for s in shapes)*L
    print(M, ' '.join(f'{k}:{sorted(v)[3]*1e3:.2f}ms/{fl/sorted(v)[3]/1e9:.0f}GF/{by/sorted(v)[3]/1e9:.1f}GB' for k,v in r.items()))
