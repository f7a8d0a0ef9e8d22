"""The native int4 decoder: one sequence's forward through a Llama-family decoder in one C call.

Why: with torch's int4 kernel, a one-token forward of SmolLM2-135M on 2 threads spends 6.1 ms in its matrix products
and 7.7 ms outside them (norms, casts, rotary, cache writes, attention calls: about 25 small torch ops a layer,
docs/quantized.md). llama.cpp does the whole token in 11 ms. This decoder runs every layer of a forward in C
(``csrc/q4_decoder.c``): the int4 products unpack each weight group to fp32 once for up to four rows, and the
norms, rotary, cache writes and attention run beside them in the same OpenMP region, so a token costs one call
from Python.

Numbers: activations stay fp32 and a weight is ``q * d + m`` in fp32 (GGUF Q4_1's own formula, from the same codes the
torch path packs), so the decoder computes the prepared fp32 model up to summation order, the rounding of the zero
point and the MLP's SiLU (with AVX-512, its exponential a polynomial within about 2e-7 relative), where torch's kernel
rounds activations, scales and zeros to bfloat16. With ``int8_activations`` (the ``native-q8`` kernel) each product's
input is rounded to int8 in blocks of 32, as llama.cpp does, and the products run on AVX-512 VNNI
(:class:`NativeCodesQ8`): lossy in the activations, about 3x cheaper. The lm_head can come from the GGUF's own Q8_0
blocks (:class:`NativeHead`).

Exactness: every value of a row is computed by the same instructions in the same order whatever the step's other
rows are (see the C file's header), and each row attends to exactly the keys it may see in slot order. So greedy
Medusa through this decoder equals plain greedy through it (``tests/test_native.py``).

The library is compiled on first use with the system's C compiler (``$CC``, else ``cc``), ``-O3 -march=native``, into
the medusa cache folder, keyed by the source, the compiler, the flags and this CPU's model and instruction sets (a
cache folder shared by other machines gets one build each); :func:`native_unavailable` says why it cannot be (no
compiler, a failed build) and names what works instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "q4_decoder.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
"""``-ffp-contract=off``: the compiler fuses no multiply-add by itself, so a value is computed alike in a loop's
vector body and its remainder (the row invariance the C file's header relies on)."""
GROUP = 32
CHANNEL_BLOCK = 4
"""Output channels the C product computes together: a layer's output size must be a multiple of it."""

_LIBRARY: dict[str, object] = {}


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "q_heads", "kv_heads", "head_dim", "intermediate",
                                                     "layers")] + [
        ("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("format", ctypes.c_int64),
        ("codes", ctypes.POINTER(ctypes.c_void_p)), ("d", ctypes.POINTER(ctypes.c_void_p)),
        ("m", ctypes.POINTER(ctypes.c_void_p)), ("norms", ctypes.POINTER(ctypes.c_void_p))]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cpu() -> str:
    """This CPU's model name and feature flags (what ``-march=native`` compiles for), as ``/proc/cpuinfo`` gives
    them; the platform's description elsewhere."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted))


def library_key() -> str:
    """16 hex digits naming this build: the source, the compiler and its version, the flags and the CPU (a profile's
    figures for the native decoder are for one build: :attr:`medusa.engines.quantized.QuantizedEngine.profile_name`
    carries its first 8)."""
    if "key" not in _LIBRARY:
        compiler = _compiler() or "none"
        try:
            version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            version = ""
        blob = SOURCE.read_bytes() + " ".join((compiler, version, *FLAGS, _cpu())).encode()
        _LIBRARY["key"] = hashlib.sha256(blob).hexdigest()[:16]
    return _LIBRARY["key"]


def library_path() -> Path:
    """Where the compiled library for this source, compiler and flags lives (it may not exist yet)."""
    from medusa.profile import cache_dir

    return cache_dir() / "kernels" / f"q4_decoder-{library_key()}.so"


def native_unavailable() -> str | None:
    """Why the native decoder cannot run here (no C compiler, the build failed), or ``None`` once its library is
    built and loaded."""
    try:
        _library()
    except RuntimeError as e:
        return str(e)
    return None


def _library():
    """The loaded library, compiled first if needed (atomically: a half-written file is never loaded).

    Raises:
        RuntimeError: no C compiler, or the build failed (the compiler's first error lines in the message).
    """
    if "lib" in _LIBRARY:
        return _LIBRARY["lib"]
    path = library_path()
    if not path.exists():
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("the native int4 decoder is compiled on first use and no C compiler was found ($CC, "
                               "cc, gcc): install one (Debian: apt install gcc), or use kernel 'torch'")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            done = subprocess.run([compiler, *FLAGS, "-o", str(out), str(SOURCE), "-lm"], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                first = "\n".join(done.stderr.strip().splitlines()[:5])
                raise RuntimeError(f"building the native int4 decoder with {compiler} failed:\n{first}\nuse kernel "
                                   "'torch'")
            os.replace(out, path)
    lib = ctypes.CDLL(str(path))
    lib.medusa_q4_isa.restype = ctypes.c_char_p
    lib.medusa_q4_product.restype = None
    lib.medusa_q4_product.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.medusa_q8_supported.restype = ctypes.c_int
    lib.medusa_f32_product.restype = None
    lib.medusa_f32_product.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.medusa_q8_product.restype = None
    lib.medusa_q8_product.argtypes = lib.medusa_q4_product.argtypes
    lib.medusa_q8_0_head.restype = ctypes.c_int
    lib.medusa_q8_0_head.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.medusa_q8_0_head_q8.restype = ctypes.c_int
    lib.medusa_q8_0_head_q8.argtypes = lib.medusa_q8_0_head.argtypes
    lib.medusa_hydra_level.restype = ctypes.c_int
    lib.medusa_hydra_level.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_int]
    lib.medusa_q4_forward_rows.restype = ctypes.c_int
    lib.medusa_q4_forward_rows.argtypes = [ctypes.POINTER(_Model), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.medusa_q4_forward.restype = ctypes.c_int
    lib.medusa_q4_forward.argtypes = [ctypes.POINTER(_Model), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    _LIBRARY["lib"] = lib
    return lib


def isa() -> str:
    """The vector instructions the library was built for: ``avx512``, ``avx2`` or ``scalar``, and ``+vnni`` where its
    int8-activation products run on AVX-512 VNNI (else on portable loops, correct but many times slower)."""
    lib = _library()
    return lib.medusa_q4_isa().decode() + ("+vnni" if lib.medusa_q8_supported() else "")


class _NativeWeight:
    """What both layouts share: the shape check and the product call (:attr:`kernel`, a function of the library
    taking ``x, M, K, codes, d, m, N, y, threads``)."""

    block: int
    kernel: str
    what: str

    def _check(self, n: int, k: int) -> None:
        if n % self.block or k % GROUP:
            raise ValueError(f"the native {self.what} product takes an output size that is a multiple of "
                             f"{self.block} and an input size that is a multiple of {GROUP}, got {n} x {k}")
        self.out_features, self.in_features = n, k

    def product(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """``x`` ``(M, K)`` fp32 -> ``(M, N)`` fp32 (for tests and the studies; decoding calls the whole forward)."""
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        getattr(_library(), self.kernel)(x.data_ptr(), x.shape[0], self.in_features, self.codes.data_ptr(),
                                         self.d.data_ptr(), self.m.data_ptr(), self.out_features, y.data_ptr(),
                                         threads or torch.get_num_threads())
        return y


class NativeCodes(_NativeWeight):
    """One weight ``(N, K)`` as the C product takes it: nibble-packed codes ``(N, K/2)`` uint8 and fp32 ``d``,
    ``m`` ``(N, K/32)``, with ``W = q * d + m``.

    Args:
        codes: ``(N, K)`` uint8 in 0..15; ``scale``, ``zero``: ``(N, K/32)`` with ``W = (q - 8) * scale + zero``
            (:class:`medusa.engines.int4.Int4Codes`).

    Raises:
        ValueError: ``N`` is not a multiple of :data:`CHANNEL_BLOCK` or ``K`` of :data:`GROUP`.
    """

    block, kernel, what = CHANNEL_BLOCK, "medusa_q4_product", "int4"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        n, k = codes.shape
        self._check(n, k)
        groups = codes.reshape(n, k // GROUP, GROUP)
        self.codes = (groups[..., :16] | (groups[..., 16:] << 4)).to(torch.uint8).contiguous().reshape(n, k // 2)
        self.d = scale.float().contiguous()
        self.m = (zero.float() - 8 * scale.float()).contiguous()

    def weight(self) -> torch.Tensor:
        """The fp32 ``(N, K)`` weights the product computes with."""
        low, high = (self.codes & 15).float(), (self.codes >> 4).float()
        n, k = self.out_features, self.in_features
        q = torch.cat([low.reshape(n, k // GROUP, 16), high.reshape(n, k // GROUP, 16)], -1).reshape(n, k)
        return q * self.d.repeat_interleave(GROUP, 1) + self.m.repeat_interleave(GROUP, 1)


class NativeCodesQ8(_NativeWeight):
    """One weight ``(N, K)`` as the int8-activation (VNNI) product takes it: blocks of 16 output channels, their
    codes interleaved four input features at a time (the C file's layout), ``d`` and ``m`` in fp16 ``(N/16, K/32,
    16)``; ``W = q * d + m`` with ``d``, ``m`` rounded to fp16 (exact for a GGUF's Q4_0/Q4_1 blocks, whose scales
    are fp16). Activations are rounded to int8 per row and group of 32 (llama.cpp's Q8 blocks), so the product is
    ``q8(x) W^T``, lossy in ``x``.

    Raises:
        ValueError: ``N`` is not a multiple of 16 or ``K`` of :data:`GROUP`.
    """

    block, kernel, what = 16, "medusa_q8_product", "int8-activation"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        n, k = codes.shape
        self._check(n, k)
        g = k // GROUP
        q = codes.to(torch.uint8).reshape(n // 16, 16, g, 8, 4)  # (block, channel, group, quad, t)
        q = q.permute(0, 2, 3, 1, 4)  # (block, group, quad, channel, t)
        self.codes = (q[:, :, :4] | (q[:, :, 4:] << 4)).contiguous().reshape(n, k // 2)  # 256 bytes a block's group
        self.d = scale.float().reshape(n // 16, 16, g).transpose(1, 2).to(torch.float16).contiguous()
        self.m = (zero.float() - 8 * scale.float()).reshape(n // 16, 16, g).transpose(1, 2).to(
            torch.float16).contiguous()

    def weight(self) -> torch.Tensor:
        """The fp32 ``(N, K)`` weights the product computes with."""
        n, k = self.out_features, self.in_features
        packed = self.codes.reshape(n // 16, k // GROUP, 4, 16, 4)
        q = torch.cat([packed & 15, packed >> 4], 2)  # (block, group, quad 0..7, channel, t)
        q = q.permute(0, 3, 1, 2, 4).reshape(n, k).float()
        d = self.d.transpose(1, 2).reshape(n, k // GROUP).float().repeat_interleave(GROUP, 1)
        m = self.m.transpose(1, 2).reshape(n, k // GROUP).float().repeat_interleave(GROUP, 1)
        return q * d + m


class NativeDense:
    """One fp32 weight ``(N, K)`` as the C fp32 product takes it (the engine ``native``): the weight itself, row-major.
    Each output is one fused multiply-add chain along ``K`` and one lane reduction, the same instructions whatever the
    other rows (the C file's "fp32 weights" section): a row's bits do not depend on the rows beside it.

    Args:
        weight: ``(N, K)`` fp32; a contiguous tensor is used as it is (not copied), else copied once.
    """

    def __init__(self, weight: torch.Tensor):
        self.lib = _library()
        self.codes = weight.detach().float().contiguous()  # the C model's weight pointer (d and m are not read)
        self.out_features, self.in_features = self.codes.shape
        self.d = self.m = _EMPTY

    def product(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """``x`` ``(M, K)`` -> ``(M, N)`` fp32, ``M`` may be 0."""
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        if len(x):
            self.lib.medusa_f32_product(x.data_ptr(), x.shape[0], self.in_features, self.codes.data_ptr(),
                                        self.out_features, y.data_ptr(), threads or torch.get_num_threads())
        return y

    def weight(self) -> torch.Tensor:
        """The fp32 ``(N, K)`` weights the product computes with."""
        return self.codes


_EMPTY = torch.zeros(1)  # a valid pointer for the fields the fp32 format does not read


class NativeHead:
    """An lm_head held as a GGUF's Q8_0 blocks, ``W = d q`` (``q`` int8, one fp32 ``d`` per 32 weights), computed in
    C: the prepared fp32 lm_head's weights exactly, a quarter of their bytes. With fp32 activations, or with the
    hidden states rounded to int8 blocks on VNNI (``int8_activations``, the ``native-q8`` kernel's way: lossy in the
    activations, as llama.cpp's lm_head).

    Args:
        codes: ``(V, K)`` int8; ``d``: ``(V, K / 32)``.

    Raises:
        ValueError: ``int8_activations`` with a vocabulary that is not a multiple of 16.
    """

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, int8_activations: bool = False):
        self.vocab, self.hidden = codes.shape
        self.lib = _library()
        self.int8_activations = int8_activations
        self.d = d.float().contiguous()
        self.codes = codes.contiguous()
        self._call = self.lib.medusa_q8_0_head
        if int8_activations:
            if self.vocab % 16:
                raise ValueError(f"the int8-activation lm_head takes a vocabulary that is a multiple of 16, got "
                                 f"{self.vocab}")
            g = self.hidden // GROUP
            q = (codes.to(torch.int16) + 128).to(torch.uint8).reshape(self.vocab // 16, 16, g, 8, 4)
            self.codes = q.permute(0, 2, 3, 1, 4).contiguous()  # (block, group, quad, channel, t): 512 B a group
            self.d = self.d.reshape(self.vocab // 16, 16, g).transpose(1, 2).contiguous()  # (block, group, 16)
            self._call = self.lib.medusa_q8_0_head_q8

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(M, K)`` hidden states -> ``(M, V)`` fp32 logits; each row's bits do not depend on the others."""
        x = hidden.float().contiguous()
        y = torch.empty(x.shape[0], self.vocab)
        if not len(x):  # a forward that scores no row (a prefill chunk before the last)
            return y
        if self._call(x.data_ptr(), x.shape[0], self.hidden, self.codes.data_ptr(), self.d.data_ptr(), self.vocab,
                      y.data_ptr(), torch.get_num_threads()) != 0:
            raise MemoryError("the native lm_head could not allocate its scratch memory")
        return y


    def hydra_level(self, bias: torch.Tensor, projection: NativeHead, embed: torch.Tensor, eps: float,
                    hidden: torch.Tensor, path_tokens: torch.Tensor, top_k: int,
                    blocks: tuple = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One Hydra head level in one C call, this head being the level's input layer ``W_in`` ``(H, (T + 1) H)``
        (Ankner et al. 2024, section 3; ``csrc/q4_decoder.c``, ``medusa_hydra_level``): per node, the RMS-normalised
        embeddings of its ``T`` path tokens beside its hidden state, ``f = h + silu(W_in x + b)``, then each of
        the head's ResBlocks in order (Hydra++'s deeper MLP, ``f = f + silu(W_j f + b_j)``), the head vocabulary's
        logits ``projection(f)``, and their ``top_k`` best ids with softmax probabilities. The same products as the
        separate calls (:meth:`logits`), for drafts only: the verify decides what is emitted.

        Args:
            bias: ``(H,)`` the input layer's bias; ``projection``: the head vocabulary's rows ``(Vh, H)``, with this
                head's activation rounding; ``embed``: the base's input embeddings ``(V, H)``; ``eps``: the norm's.
            hidden: ``(P, H)`` each node's hidden state; ``path_tokens``: ``(P, T)`` long, ``T`` = hidden input
                size / H - 1.
            blocks: ``((W_j (H, H) as a NativeHead with this head's activation rounding, b_j (H,)), ...)``, the
                ResBlocks after the input layer (none by default).

        Returns:
            ``(logits (P, Vh), ids (P, top_k) long, probs (P, top_k))``, best first.

        Raises:
            ValueError: shapes that do not fit, ``projection`` rounds activations otherwise, or a path token that is
                not an embedding row.
            MemoryError: the C side could not allocate its scratch.
        """
        x = hidden.float().contiguous()
        tokens = path_tokens.to(torch.int64).contiguous()
        count, size = x.shape
        if (tokens.shape != (count, self.hidden // size - 1) or self.hidden % size or projection.hidden != size
                or self.vocab != size or tuple(embed.shape[1:]) != (size,) or bias.shape != (size,)
                or projection.int8_activations != self.int8_activations or not 0 < top_k <= projection.vocab
                or any((w.vocab, w.hidden) != (size, size) or w.int8_activations != self.int8_activations
                       or b.shape != (size,) for w, b in blocks)):
            raise ValueError(f"a Hydra level's shapes do not fit: hidden {tuple(x.shape)}, tokens "
                             f"{tuple(tokens.shape)}, input layer ({self.vocab}, {self.hidden}), projection "
                             f"({projection.vocab}, {projection.hidden}), top_k {top_k}, ResBlocks "
                             f"{[((w.vocab, w.hidden), tuple(b.shape)) for w, b in blocks]}")
        embed, bias = embed.float().contiguous(), bias.float().contiguous()
        block_bias = [b.float().contiguous() for _, b in blocks]  # kept alive through the call
        pointers = ctypes.c_void_p * max(len(blocks), 1)
        block_codes = pointers(*(w.codes.data_ptr() for w, _ in blocks))
        block_d = pointers(*(w.d.data_ptr() for w, _ in blocks))
        block_biases = pointers(*(b.data_ptr() for b in block_bias))
        logits = torch.empty(count, projection.vocab)
        ids = torch.empty(count, top_k, dtype=torch.int64)
        probs = torch.empty(count, top_k)
        if count == 0:
            return logits, ids, probs
        done = self.lib.medusa_hydra_level(
            x.data_ptr(), count, size, tokens.data_ptr(), tokens.shape[1], embed.data_ptr(), embed.shape[0], eps,
            self.codes.data_ptr(), self.d.data_ptr(), bias.data_ptr(), len(blocks), block_codes, block_d,
            block_biases, projection.codes.data_ptr(),
            projection.d.data_ptr(), projection.vocab, int(self.int8_activations), logits.data_ptr(), top_k,
            ids.data_ptr(), probs.data_ptr(), torch.get_num_threads())
        if done == -2:
            raise ValueError(f"a path token is not an id of the {embed.shape[0]}-row embedding table: "
                             f"{tokens.min().item()}..{tokens.max().item()}")
        if done == -3:
            raise ValueError(f"top_k must be in 1..{projection.vocab}, got {top_k}")
        if done != 0:
            raise MemoryError("the native Hydra level could not allocate its scratch memory")
        return logits, ids, probs


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, K)`` weights rounded to Q8_0 blocks of 32 (GGUF's ``Q8_0``: ``w = d q``, ``d = max|w| / 127`` per block,
    ``q = round(w / d)`` in -127..127): ``(codes (N, K) int8, d (N, K / 32) fp32)``. A block of zeros gets ``d`` 0.

    Raises:
        ValueError: ``K`` is not a multiple of 32.
    """
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"Q8_0 blocks take an input size that is a multiple of {GROUP}, got {k}")
    blocks = weight.detach().float().reshape(n, k // GROUP, GROUP)
    d = blocks.abs().amax(-1) / 127  # (N, K / 32)
    codes = torch.where(d[..., None] > 0, blocks / d.clamp_min(torch.finfo(torch.float32).tiny)[..., None],
                        torch.zeros(())).round().clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k), d


def q8_0_product(weight: torch.Tensor, int8_activations: bool):
    """``rows (M, K) -> (M, N)`` fp32 through the C Q8_0 product (:class:`NativeHead`) on ``weight`` ``(N, K)``
    rounded to Q8_0 blocks (:func:`quantize_q8_0`), a quarter of the fp32 bytes: how the heads draft beside the
    native int4 decoder (``int8_activations`` with ``native-q8``). Lossy in the weights (and in the activations with
    ``int8_activations``), so for drafts only: the verify decides what is emitted. ``None`` where the shape does not
    fit (``K`` not a multiple of 32, or ``N`` of 16) or the library cannot be built."""
    n, k = weight.shape
    if k % GROUP or n % 16 or native_unavailable() is not None:
        return None
    head = NativeHead(*quantize_q8_0(weight), int8_activations=int8_activations)
    return head.logits


def _visible(seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C forward's CSR of which step tokens each token sees: ``seen`` ``(M, N)`` bool -> ``(offsets (M + 1,),
    index (sum,))`` int32, token i's visible step tokens ``index[offsets[i]:offsets[i + 1]]`` in ascending order."""
    offsets = torch.zeros(seen.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(seen.sum(1), 0, out=offsets[1:])
    return offsets, seen.nonzero()[:, 1].to(torch.int32).contiguous()


def _pointers(tensors: list[torch.Tensor]):
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


_BUILDS = itertools.count(1)
"""Numbers the :class:`NativeDecoder` objects made in this process (one per build of an engine's weights)."""
WRITER = "_native_writer"
"""A cache's attribute: the :attr:`NativeDecoder.build` that wrote every position it holds, or 0 where another
forward (a ``static`` one, another build) wrote some of them."""


class PrefixSnapshot:
    """The keys and values of a prompt's first positions, as :meth:`NativeDecoder.snapshot` copied them: ``kv``
    ``(layers * 2 * kv_heads, length, head_dim)`` fp32, ``length`` positions, and ``build``, the number of the
    decoder (the engine's build of the weights) that wrote all of them."""

    def __init__(self, build: int, kv: torch.Tensor, length: int):
        self.build, self.kv, self.length = build, kv, length

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class NativeDecoder:
    """The decoder of a Llama-family model run by one C call per forward (see the module docstring). Same
    interface as :class:`medusa.engines.lean.LeanDecoder`.

    Args:
        decoder: the engine's shadow of the decoder stack (its embeddings, norms and rotary embedding are read).
        fused_codes: names (qualified under the decoder) -> one :class:`medusa.engines.int4.Int4Codes` with their
            outputs side by side; or with ``dense``, -> one ``(N, K)`` fp32 weight with their outputs stacked.
        int8_activations: the products round their inputs to int8 blocks and run on VNNI (:class:`NativeCodesQ8`;
            lossy in the activations, as llama.cpp); else fp32 activations (:class:`NativeCodes`).
        dense: the weights are fp32 (:class:`NativeDense`, the engine ``native``): the decoder computes the fp32
            model itself, up to summation order and the exponential's polynomial (about 2e-7 relative).

    Raises:
        RuntimeError: the library cannot be built (:func:`native_unavailable`).
        ValueError: a layer's shape the product cannot take; ``dense`` with ``int8_activations``.
    """

    def __init__(self, decoder, fused_codes, int8_activations: bool = False, dense: bool = False):
        self.lib = _library()
        if dense and int8_activations:
            raise ValueError("the fp32 native decoder runs fp32 activations: dense and int8_activations exclude "
                             "each other")
        if int8_activations and not self.lib.medusa_q8_supported():
            logger.warning("native-q8: this CPU's build (%s) has no AVX-512 VNNI, so the int8-activation products "
                           "run on portable loops, many times slower; kernel 'native' (fp32 activations) is the "
                           "faster choice here", isa())
        self.int8_activations = int8_activations
        self.dense = dense
        self.stack = decoder
        rope = getattr(decoder.config, "rope_scaling", None) or {}
        self.dynamic_rope = rope.get("rope_type", rope.get("type")) == "dynamic"
        first = decoder.layers[0]
        attn = first.self_attn
        self.head_dim = attn.head_dim
        self.hidden = decoder.embed_tokens.weight.shape[1]
        self.q_heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.build = next(_BUILDS)
        """This decoder's number in the process: a prefix snapshot is restored only by the build that made it."""
        self.intermediate = first.mlp.gate_proj.out_features
        self.scaling = float(attn.scaling)
        self.eps = float(first.input_layernorm.variance_epsilon)
        self.weights: list[NativeCodes | NativeCodesQ8 | NativeDense] = []
        for i in range(len(decoder.layers)):
            prefix = f"layers.{i}"
            for names in ([f"{prefix}.self_attn.{p}_proj" for p in "qkv"], [f"{prefix}.self_attn.o_proj"],
                          [f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"], [f"{prefix}.mlp.down_proj"]):
                if dense:
                    self.weights.append(NativeDense(fused_codes(names)))
                    continue
                c = fused_codes(names)
                self.weights.append((NativeCodesQ8 if int8_activations else NativeCodes)(c.codes, c.scale, c.zero))
        self.norms = [n.weight.detach().float().contiguous() for layer in decoder.layers
                      for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.norms.append(decoder.norm.weight.detach().float().contiguous())
        self._arrays = [_pointers([w.codes for w in self.weights]), _pointers([w.d for w in self.weights]),
                        _pointers([w.m for w in self.weights]), _pointers(self.norms)]  # kept alive with the struct
        self.model = _Model(self.hidden, self.q_heads, self.kv_heads, self.head_dim, self.intermediate,
                            len(decoder.layers), self.eps, self.scaling, 2 if dense else int(int8_activations),
                            *(ctypes.cast(a, ctypes.POINTER(ctypes.c_void_p)) for a in self._arrays))

    def nbytes(self) -> int:
        """Bytes of the packed codes and their fp32 ``d`` and ``m`` (of the fp32 weights with ``dense``)."""
        parts = ("codes",) if self.dense else ("codes", "d", "m")
        return sum(getattr(w, p).numel() * getattr(w, p).element_size() for w in self.weights for p in parts)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``(N, D)`` fp32 at ``positions``, read from a table the model's rotary embedding filled
        once for positions ``0 .. P - 1`` (made again, twice as long, when a position passes it): a position's values
        are then the same bits in every step, whatever the step's other positions. Dynamic rope scaling, whose
        frequencies depend on the longest position asked for, calls the embedding each time instead."""
        if self.dynamic_rope:  # its frequencies follow the longest position asked for: no table
            cos, sin = self.stack.rotary_emb(x[None], position_ids=positions[None])  # (1, N, D) each
            return cos[0].float().contiguous(), sin[0].float().contiguous()
        top = int(positions.max()) + 1
        table = self.__dict__.get("_rotary_table")
        if table is None or table[0].shape[0] < top:
            size = max(256, 1 << (top - 1).bit_length())
            cos, sin = self.stack.rotary_emb(x[None, :1], position_ids=torch.arange(size)[None])  # (1, P, D) each
            table = self.__dict__["_rotary_table"] = (cos[0].float().contiguous(), sin[0].float().contiguous())
        return table[0][positions].contiguous(), table[1][positions].contiguous()

    def snapshot(self, cache, length: int) -> PrefixSnapshot | None:
        """A copy of the first ``length`` positions of a one-row ``cache`` this decoder wrote (every layer's keys
        and values), for :meth:`restore` into another cache: ``None`` where the cache holds fewer positions or was
        not written by a decoder of this layout. Each token's keys and values are its own (the forward's sums never
        mix tokens), so they are the ones a forward over any longer prompt with the same first ``length`` tokens
        writes there (:mod:`medusa.decode.prefix`)."""
        store = getattr(cache, "slot_store", None)
        if (store is None or cache.length < length or length < 1 or cache.__dict__.get(WRITER) != self.build
                or store.shape[0] != len(cache.layers) * 2 * self.kv_heads):
            return None  # also where some position came from another forward (another build, a static one)
        return PrefixSnapshot(self.build, store[:, :length].clone(), length)

    def restore(self, snapshot: PrefixSnapshot, cache, length: int) -> bool:
        """Write the first ``length`` positions of ``snapshot`` into the fresh one-row ``cache`` (nothing written
        yet) and count them as cached. ``False``, nothing written, where the snapshot was made by another decoder
        (the engine rebuilt its weights since), holds fewer positions, or the cache is not fresh or too small."""
        if (snapshot.build != self.build or length > snapshot.length or cache.length != 0
                or length > cache.capacity or any(layer.keys is not None for layer in cache.layers)):
            return False
        self._buffers(cache)
        store = cache.slot_store
        if store.shape[0] != snapshot.kv.shape[0] or store.shape[2:] != snapshot.kv.shape[2:]:
            return False
        store[:, :length] = snapshot.kv[:, :length]
        cache.length = length
        cache.__dict__[WRITER] = self.build
        return True

    def _buffers(self, cache):
        """The cache's ``(1, Hkv, capacity, D)`` fp32 key and value buffers of every layer, made at the first write."""
        shape = (1, self.kv_heads, cache.capacity, self.head_dim)
        if all(layer.keys is None for layer in cache.layers):
            # One store for every layer's keys and values, the layers' tensors views of it: compacting the kept
            # path (:meth:`medusa.engines.static_cache.SlotCache.keep`) is then one gather and one write in all.
            store = torch.zeros(len(cache.layers), 2, *shape)
            for layer, (keys, values) in zip(cache.layers, store, strict=True):
                layer.keys, layer.values = keys, values
                layer.is_initialized = True
            cache.slot_store = store.view(-1, cache.capacity, self.head_dim)  # (layers * 2 * Hkv, capacity, D)
        for layer in cache.layers:
            if layer.keys is None:
                layer.keys, layer.values = torch.zeros(shape), torch.zeros(shape)
                layer.is_initialized = True
        return ([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, cache, mask,
                layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of ``N`` new tokens of one row after ``cache.length`` cached ones, written into ``cache``
        (:meth:`medusa.engines.lean.LeanDecoder.forward`'s arguments and results; ``mask`` is not read: every row
        attends to exactly the slots ``tree_mask`` lets it see).

        Raises:
            medusa.engines.static_cache.CacheFullError: the step does not fit the cache.
            MemoryError: the C side could not allocate its scratch memory.
        """
        n, length = len(input_ids), cache.length
        cache.begin_step(n)
        # which build wrote this cache's positions (snapshot() copies only a cache one build wrote entirely)
        cache.__dict__[WRITER] = self.build if length == 0 or cache.__dict__.get(WRITER) == self.build else 0
        x = self.stack.embed_tokens(input_ids[None])[0].float().contiguous()  # (N, H), new: the C call overwrites it
        cos, sin = self._rotary(x, positions)
        offsets, index = _visible(tree_mask)
        keys, values = self._buffers(cache)
        pointers = cache.__dict__.get("_native_pointers")
        if pointers is None or pointers[0] != (keys[0].data_ptr(), values[0].data_ptr()):
            pointers = ((keys[0].data_ptr(), values[0].data_ptr()), _pointers(keys), _pointers(values))
            cache.__dict__["_native_pointers"] = pointers  # made again if the buffers were replaced
        kept, kept_ptrs = self._kept(n, layers)
        status = self.lib.medusa_q4_forward(
            ctypes.byref(self.model), x.data_ptr(), n, cos.data_ptr(), sin.data_ptr(), offsets.data_ptr(),
            index.data_ptr(), length, cache.capacity, pointers[1], pointers[2], kept_ptrs,
            torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"the native decoder could not allocate its scratch memory for {n} tokens")
        cache.length += n
        return x, self._features(x, kept, layers)

    def _kept(self, m: int, layers: tuple[int, ...]) -> tuple[dict, ctypes.Array]:
        """``(M, H)`` buffers for the outputs of ``layers`` (the last layer's is the forward's own output), and the
        per-layer pointer array the C forward takes (NULL where a layer's output is not kept)."""
        count = len(self.stack.layers)
        kept = {i: torch.empty(m, self.hidden) for i in layers if i != count - 1}
        return kept, (ctypes.c_void_p * count)(*(kept[i].data_ptr() if i in kept else None for i in range(count)))

    def _features(self, x: torch.Tensor, kept: dict, layers: tuple[int, ...]) -> torch.Tensor | None:
        """``(M, len(layers) * H)`` the kept layers' outputs side by side (``None`` without ``layers``)."""
        last = len(self.stack.layers) - 1
        return None if not layers else torch.cat([x if i == last else kept[i] for i in layers], -1)

    def forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, valid_len: torch.Tensor,
                     new_visible: torch.Tensor, cache, layers: tuple[int, ...] = ()):
        """One forward of ``B`` rows of ``N`` new tokens in one C call, on a batched
        :class:`medusa.engines.static_cache.SlotCache` (:func:`medusa.engines.static_cache.forward_rows`'s arguments
        and results): row b's tokens are written at slots ``length .. length + N - 1`` of its own cache and attend to
        its slots ``0 .. valid_len[b] - 1``, then to the step's tokens ``new_visible`` lets them see. A token's bits
        do not depend on the other rows (every sum runs over its own values in slot order), so a row decodes as it
        would alone.

        Args:
            input_ids: ``(B, N)`` long; positions: ``(B, N)`` long; valid_len: ``(B,)`` long, each at most the
                cache's length; new_visible: ``(N, N)`` or ``(B, N, N)`` bool, each token seeing itself.

        Returns:
            ``(B, N, H)`` hidden states after the final norm; with ``layers``, ``(hidden, features (B, N,
            len(layers) * H))``.

        Raises:
            medusa.engines.static_cache.CacheFullError: the step does not fit the cache.
            ValueError: ``valid_len`` beyond the cache's length, or a token that does not see itself.
            MemoryError: the C side could not allocate its scratch memory.
        """
        if input_ids.ndim != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
            raise ValueError(f"a batched forward takes (B, N) token ids with B, N >= 1, got shape "
                             f"{tuple(input_ids.shape)}")
        b, n = input_ids.shape
        if tuple(positions.shape) != (b, n):
            raise ValueError(f"positions of shape {tuple(positions.shape)} for token ids of shape {(b, n)}")
        if new_visible.shape[-2:] != (n, n) or new_visible.ndim not in (2, 3) or (
                new_visible.ndim == 3 and new_visible.shape[0] not in (1, b)):
            raise ValueError(f"new_visible of shape {tuple(new_visible.shape)}, expected {(n, n)} or {(b, n, n)}")
        if any(layer.keys is None for layer in cache.layers):
            raise ValueError("a batched forward runs on a cache of prefilled rows (Engine.stack_rows), got an empty "
                             "one")
        length = cache.length
        cached = valid_len.to(torch.int64).contiguous()
        if len(cached) != b or int(cached.max()) > length or int(cached.min()) < 0:
            raise ValueError(f"valid_len {cached.tolist()} for {b} rows of a cache of length {length}")
        seen = new_visible.to(torch.bool).expand(b, n, n)
        if not bool(seen.diagonal(0, 1, 2).all()):
            raise ValueError("every new token must see itself (new_visible's diagonal)")
        cache.begin_step(n)
        x = self.stack.embed_tokens(input_ids).reshape(b * n, -1).float().contiguous()  # new: the C call writes it
        cos, sin = self._rotary(x, positions.reshape(-1))
        offsets, index = _visible(seen.reshape(b * n, n))
        keys = [layer.keys.contiguous() for layer in cache.layers]
        values = [layer.values.contiguous() for layer in cache.layers]
        expected = (b, self.kv_heads, cache.capacity, self.head_dim)
        for layer, k, v in zip(cache.layers, keys, values, strict=True):
            for name, t in (("keys", k), ("values", v)):
                if t.dtype != torch.float32 or t.shape != expected:
                    raise ValueError(f"a batched cache of {b} rows holds {name} of shape {tuple(t.shape)} and dtype "
                                     f"{t.dtype}, expected {expected} float32")
            layer.keys, layer.values = k, v
        kept, kept_ptrs = self._kept(b * n, layers)
        status = self.lib.medusa_q4_forward_rows(
            ctypes.byref(self.model), x.data_ptr(), b * n, n, cos.data_ptr(), sin.data_ptr(), offsets.data_ptr(),
            index.data_ptr(), cached.data_ptr(), length, cache.capacity, _pointers(keys), _pointers(values),
            kept_ptrs, torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"the native decoder could not allocate its scratch memory for {b} x {n} tokens")
        cache.length += n
        hidden = x.view(b, n, -1)
        return (hidden, self._features(x, kept, layers).view(b, n, -1)) if layers else hidden
