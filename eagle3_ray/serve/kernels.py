"""CPU serving kernels for the verifier and drafter: attention that computes for every token of a
verify what a one-token decode step computes (batch invariant, so greedy speculation is exact in
bf16; MLA's value heads narrower than its query heads included), tree attention (every
root-to-leaf path of a speculative tree attends as a chain), linears on oneDNN/MKL kernels
suited to the few rows a verify carries, tuned per host, and MoE blocks that route and compute
a verify's tokens one at a time (batch invariant).

    python -m eagle3_ray.bench.verify_cost --threads 1   # a verify of k tokens vs k decode steps
"""
from __future__ import annotations

import functools
import time

import torch


INVARIANT_ATTENTION = "eagle3_batch_invariant"


def batch_invariant_attention(module, query, key, value, attention_mask, scaling=None,
                              dropout=0.0, tree=None, **kwargs):
    """Causal attention for one unpadded sequence whose every query row computes what it would
    in a one-token forward. On GPUs and where oneDNN has CPU kernels for bf16 (AVX512-BF16 /
    AMX; _one_token_at_a_time): scores against all cached keys (one matmul per KV head), the keys a
    row may not see masked to -inf after the matmul, softmax, then probabilities @ values; a
    masked key adds an exact 0 to each of a row's sums and those matmuls' per-element results
    depend neither on the rows nor on the keys they carry (checked bit for bit on CPU bf16:
    2-33 rows, 1 and 2 threads; with AMX once the keys are padded to a multiple of 32,
    _pad_keys). Elsewhere on CPUs (bf16 on an AVX2-only one: ATen's fallback GEMM sums over the
    keys in an order set by their count; on SmolLM2 a 9-token verify then differed from 9
    decode steps in layer 1. fp32 anywhere: torch's fp32 matmuls run on MKL, not oneDNN, and
    theirs differed between 1, 2 and 8 rows on an AVX2-only EPYC) each token attends on its own to
    exactly the keys it sees: the shapes, and so the kernels, of a one-token forward. This
    matters most where a KV head serves one query head (MLA, nh == nkv): a one-token forward's
    matmuls then have one row (a GEMV) against a verify's several. A fused kernel (SDPA)
    blocks its softmax over the keys differently per query length and does neither. A prefill
    (no cache) is shared by every path and stays fused. tests/serve/test_speculate.py and
    tests/test_embedded.py.
    tree (a speculative tree verify: tree_layout): the q new tokens form a tree whose every
    root-to-leaf path attends as a chain of its own (_tree_attention).
    query/key [1, nh, q, D] / [1, nkv, kv, D], value [1, nkv, kv, Dv] -> [1, q, nh, Dv]
    (transformers' interface; MLA's Dv differs from D: DeepSeek-V3 192 / 128)."""
    b, nh, q, d = query.shape
    nkv, kv, dv = key.shape[1], key.shape[2], value.shape[-1]
    if b != 1:
        raise ValueError(f"{INVARIANT_ATTENTION} attention takes batch 1, got {b}")
    if tree is not None:
        return _tree_attention(module, query, key, value, scaling, tree)
    if q == kv:                                                # prefill
        key = key.repeat_interleave(nh // nkv, dim=1)
        value = value.repeat_interleave(nh // nkv, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                               scale=scaling)
        return out.transpose(1, 2), None
    g = nh // nkv                                              # query heads per KV head
    scale = scaling if scaling is not None else d ** -0.5
    if q > 1 and _one_token_at_a_time(query):                  # a token at a time
        outs = [batch_invariant_attention(module, query[:, :, i:i + 1], key[:, :, :kv - q + i + 1],
                                          value[:, :, :kv - q + i + 1], None, scale)[0]
                for i in range(q)]
        return torch.cat(outs, 1), None
    rows = query.reshape(nkv, g * q, d)               # row j·q + i: head kv·g + j, token i
    s = _rows_matmul(rows, key[0].transpose(-1, -2)).float() * scale   # [nkv, g·q, kv]
    if q > 1:                                                  # token i sees keys 0 .. kv-q+i
        pos = torch.arange(kv - q, kv, device=query.device).repeat(g)            # [g·q]
        hidden = torch.arange(kv, device=query.device) > pos[:, None]             # [g·q, kv]
        s = s.masked_fill(hidden, float("-inf"))
    s, v = _pad_keys(s, value[0])                              # [nkv, g·q, kv'], [nkv, kv', Dv]
    out = _rows_matmul(s.softmax(-1).to(value.dtype), v)       # [nkv, g·q, Dv]
    return out.reshape(1, nh, q, dv).transpose(1, 2), None     # [1, q, nh, Dv]


def _rows_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [.., n, K] @ b [.., K, N] with fewer than _ONEDNN_MIN_ROWS rows padded up to them, as
    FewRowLinear pads its rows (oneDNN's one-row kernels block differently from its multi-row
    ones): where a KV head serves one query head (MLA), a decode step's matmuls have a single
    row. Not measured on a bf16 oneDNN host (this one is AVX2-only): check_exact decides."""
    return (_pad_rows(a, _ONEDNN_MIN_ROWS) @ b)[..., :a.shape[-2], :]


def _one_token_at_a_time(query: torch.Tensor) -> bool:
    """Whether batch_invariant_attention runs a verify's tokens one at a time here: on CPUs,
    unless the query is bf16 and oneDNN has bf16 kernels (the matmul path's kernels, checked
    row- and key-invariant there)."""
    return query.is_cpu and not (query.dtype == torch.bfloat16
                                 and torch.bfloat16 in _packable_dtypes())


# The probabilities @ values matmul sums over the keys. With AMX (oneDNN's bf16 tiles take 32
# keys, 64 bytes, at a time) its result for a row changed with the number of keys carried when
# that was not a multiple of 32: a 2-token verify then differed from decoding in the last bits
# on ~0.3% of (keys, tokens) shapes, and greedy outputs diverged on 4 of 12 demo prompts. With
# the keys padded to a multiple of 32 (zero probabilities, zero values) none did; on AVX512-BF16
# without AMX it was invariant either way.
_KEY_BLOCK = 32


def _pad_keys(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [.., rows, K] and values [.., K, D] -> both with K padded to a multiple of
    _KEY_BLOCK: scores with -inf (probability exactly 0), values with zeros."""
    pad = -s.shape[-1] % _KEY_BLOCK
    if not pad:
        return s, v
    return (torch.nn.functional.pad(s, (0, pad), value=float("-inf")),
            torch.nn.functional.pad(v, (0, 0, 0, pad)))


def tree_layout(paths: list[list[int]], cached: int, device=None) -> dict:
    """A tree verify's index tensors, made once per forward: the q new tokens (after `cached`
    cached ones) form a tree given by its root-to-leaf paths (indices into the new tokens,
    root first). lengths: each path's. index [P, L]: each path padded to the longest with its
    last token; keys
    [P, cached + L]: the key positions each path attends over, the cached ones then its own in
    path order (the keys of decoding that path token by token); first [q]: where each token
    first occurs in index.flatten(); offsets [q]: each token's index in its path (its position
    after the cached ones). gather [P, K']: keys padded to a multiple of _KEY_BLOCK with key 0;
    hidden [L, K']: the gathered keys path token i may not see (its path's later tokens, and
    the padding, which lies past every token's last key)."""
    width = max(map(len, paths))
    index = torch.tensor([p + p[-1:] * (width - len(p)) for p in paths], device=device)
    keys = torch.cat([torch.arange(cached, device=device).expand(len(paths), cached),
                      cached + index], 1)                                  # [P, cached+L]
    first = {}
    for i, t in enumerate(index.flatten().tolist()):
        first.setdefault(t, i)
    first = torch.tensor([first[t] for t in range(len(first))], device=device)   # [q]
    gather = torch.nn.functional.pad(keys, (0, -keys.shape[1] % _KEY_BLOCK))      # [P, K']
    hidden = (torch.arange(gather.shape[1], device=device)
              > cached + torch.arange(width, device=device)[:, None])              # [L, K']
    return {"index": index, "keys": keys, "first": first, "offsets": first % width,
            "gather": gather, "hidden": hidden, "lengths": [len(p) for p in paths]}


def _tree_attention(module, query, key, value, scaling, tree: dict):
    """batch_invariant_attention of a tree verify: every path as a chain, all paths in one
    batched matmul over their own keys (the cached ones, then the path's in order, so each
    row's sums see the keys of decoding that path token by token; a padded path's extra keys
    come after every real row's last key, masked like a chain verify's later tokens). The
    gathered keys are padded to a multiple of _KEY_BLOCK with copies of key 0 at probability
    exactly 0, which adds to each sum what _pad_keys's zero values do.
    query [1, nh, q, D], key [1, nkv, kv, D], value [1, nkv, kv, Dv] -> [1, q, nh, Dv]."""
    _, nh, q, d = query.shape
    nkv, dv = key.shape[1], value.shape[-1]
    index, keys = tree["index"], tree["keys"]                              # [P, L], [P, K]
    n_paths, width = index.shape
    scale = scaling if scaling is not None else d ** -0.5
    if _one_token_at_a_time(query):                                        # a token at a time
        out = query.new_empty(1, q, nh, dv)                                # [1, q, nh, Dv]
        cached = keys.shape[1] - width
        for p, n in enumerate(tree["lengths"]):   # the path's own tokens, not its padding: a
            idx, seen = index[p, :n], keys[p, :cached + n]   # padded copy would see itself twice
            out[:, idx] = batch_invariant_attention(
                module, query[:, :, idx], key[:, :, seen], value[:, :, seen], None, scale)[0]
        return out, None
    g = nh // nkv
    qp = query[0][:, index].reshape(nkv, g, n_paths, width, d)            # [nkv, g, P, L, D]
    rows = qp.transpose(1, 2).reshape(nkv, n_paths, g * width, d)         # row j·L + i
    k, v = key[0][:, tree["gather"]], value[0][:, tree["gather"]]   # [nkv, P, K', D / Dv]
    s = _rows_matmul(rows, k.transpose(-1, -2)).float() * scale           # [nkv, P, g·L, K']
    s = s.view(nkv, n_paths, g, width, -1).masked_fill(tree["hidden"], float("-inf"))
    s = s.view(nkv, n_paths, g * width, -1)               # path token i sees keys 0 .. cached+i
    out = _rows_matmul(s.softmax(-1).to(v.dtype), v)                       # [nkv, P, g·L, Dv]
    out = out.reshape(nkv, n_paths, g, width, dv).permute(1, 3, 0, 2, 4)  # [P, L, nkv, g, Dv]
    return out.reshape(n_paths * width, nh, dv)[tree["first"]][None], None  # [1, q, nh, Dv]


# Few-row CPU matmuls (a decode step: 1 row, a speculative verify: 2-33). Measured on this
# project's 2-core AVX512-BF16 CPU and with it capped at AVX2, SmolLM2's 7 linears x 30 layers,
# 1 thread (eagle3_ray/bench/verify_cost.py measures whole verifies):
# - F.linear re-lays out a plain weight on every call; oneDNN with the weight packed once
#   (mkldnn._reorder_linear_weight) is x1.3-1.9 faster in bf16 and, in fp32 from 3 rows on,
#   x1.2-1.6 (AVX2) / x1.5-2 (AVX512). Its rows agree bit for bit for every row count from 2
#   on (not 1 vs 2: their blocking differs for K >= 1536), and in bf16 its 1-2 row kernels
#   are ~7% slower than its 3-4 row ones: batch invariant, fewer rows are padded to 4.
# - fp32 with 1-2 rows: MKL's W @ x^T streams the weight x1.5 (1 row) / x2.2 (2 rows) faster
#   than F.linear's x @ W^T (MKL's sgemv; its sgemm for 2-3 rows costs more than for 4). That
#   is the default; the ranking is the host's, so a Speculator times them (tune_few_row_kernels).
# - fp32, MKL's sgemm on a weight packed once for exactly that row count (mkl._mkl_reorder_
#   linear_weight / mkl._mkl_linear, the path torch.compile's freezing takes; a pack serves one
#   row count, so fewer rows are padded up to the tuned count that has one). On a Xeon capped at
#   AVX2, SmolLM2's linears: 2 / 4 / 8 rows 20 / 23 / 27 ms against 28 / 33 / 39 for the best
#   other kernel (1 row: 20 against F.linear's 18). Each pack costs the weight's memory again.
# - Below ~64K weight elements the fixed cost per call decides: F.linear ~3 us, oneDNN ~15 us.
# - With AMX (a Xeon with amx_bf16), oneDNN's bf16 rows agree for 1-32 rows, not from 33 on
#   (its tiles hold 16 rows; past two of them the blocking changes): batch invariant, more
#   rows run 32 at a time (a 33-token verify then streams the weights twice).
_MKL_FEW_ROWS = 2
_ONEDNN_MIN_ROWS = 4
_ONEDNN_MAX_ROWS = 32
_SMALL_WEIGHT = 1 << 16


def _packable_dtypes() -> tuple:
    """Weight dtypes oneDNN runs from packed weights on this CPU: fp32, and bf16 where torch's
    own bf16 matmuls go to oneDNN (it has bf16 kernels here and torch.backends.mkldnn is on);
    none without oneDNN. Probed once per setting of the switch."""
    return _probe_packable(torch.backends.mkldnn.enabled)


@functools.lru_cache(maxsize=None)
def _probe_packable(mkldnn_enabled: bool) -> tuple:
    ok = []
    for dtype in (torch.float32, torch.bfloat16):
        try:
            if not torch.backends.mkldnn.is_available() or (
                    dtype == torch.bfloat16 and not (
                        mkldnn_enabled and torch.ops.mkldnn._is_mkldnn_bf16_supported())):
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2, dtype=dtype))
            torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2, dtype=dtype), packed, None, "none",
                                               [], "")
            ok.append(dtype)
        except (AttributeError, RuntimeError):   # a build without these oneDNN ops
            pass
    return tuple(ok)


@functools.lru_cache(maxsize=None)
def _mkl_packable() -> bool:
    """Whether this torch has MKL's packed fp32 GEMM (x86 builds with MKL; probed once)."""
    try:
        w = torch.ones(2, 2)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
        torch.ops.mkl._mkl_linear(torch.ones(1, 2), packed, w, None, 1)
        return True
    except (AttributeError, RuntimeError):
        return False


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [.., s, K] with zero rows appended up to n: [.., max(s, n), K]."""
    return torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[-2])) if x.shape[-2] < n else x


class FewRowLinear:
    """The forward of one nn.Linear for inference on few rows, through the fastest CPU kernel
    for the row count (see above). batch_invariant: each row's output is bit for bit the same
    whatever the number of rows (one oneDNN kernel for all, fewer than 4 rows padded to 4, more
    than 32 run 32 at a time).
    With gradients, on GPUs, for other dtypes and (not batch invariant) small weights: plain
    F.linear (batch invariant: one row padded to two, a one-row GEMV rounds differently from a
    GEMM). A packed copy of the weight (oneDNN's; MKL's, one per row count it runs) is made on
    first use and again whenever the weight changes (its pointer or version)."""

    def __init__(self, layer: torch.nn.Linear, batch_invariant: bool = False):
        self.layer, self.batch_invariant = layer, batch_invariant
        self.packed, self.packed_key = None, None
        self.mkl_packed = {}             # rows -> MKL's packed copy for that row count
        self.few = {}                    # fp32, few rows: rows -> kernel (tune_few_row_kernels)

    def __getstate__(self) -> dict:      # copies and pickles leave the (opaque) packed copies out
        return {**self.__dict__, "packed": None, "packed_key": None, "mkl_packed": {}}

    def _weight_key(self) -> tuple:
        """What a packed copy was made from: the weight's pointer, version and dtype."""
        w = self.layer.weight
        return w.data_ptr(), w._version, w.dtype

    def _kernel(self, rows: int) -> tuple[str, int]:
        """(kernel, rows it runs): the choice for this row count, else that of the next tuned
        count (padded up to it), else MKL's W @ x^T for 1-2 rows and oneDNN above."""
        if rows in self.few:
            return self.few[rows], rows
        up = min((r for r in self.few if r > rows), default=None)
        if up is not None:
            return self.few[up], up
        return ("mkl" if rows <= _MKL_FEW_ROWS else "onednn"), rows

    def _mkl_linear(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """MKL's sgemm with the weight packed for `rows` rows (x padded up to them)."""
        w, bias = self.layer.weight, self.layer.bias
        key = self._weight_key()
        if rows not in self.mkl_packed or self.mkl_packed[rows][0] != key:
            self.mkl_packed[rows] = key, torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), rows)
        n = x.numel() // x.shape[-1]
        xs = _pad_rows(x.reshape(-1, w.shape[1]), rows)                       # [rows, K]
        y = torch.ops.mkl._mkl_linear(xs, self.mkl_packed[rows][1], w, bias, rows)[:n]
        return y.reshape(*x.shape[:-1], w.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, bias = self.layer.weight, self.layer.bias
        rows, s = x.numel() // x.shape[-1], x.shape[-2]
        if (torch.is_grad_enabled() or w.device.type != "cpu" or w.dtype not in _packable_dtypes()
                or (w.numel() < _SMALL_WEIGHT and not self.batch_invariant)):
            if rows != 1 or not self.batch_invariant:
                return torch.nn.functional.linear(x, w, bias)
            return torch.nn.functional.linear(_pad_rows(x, 2), w, bias)[..., :1, :]
        kernel, tuned = self._kernel(rows)
        if w.dtype == torch.float32 and not self.batch_invariant and kernel != "onednn":
            if kernel == "linear" or (kernel == "mkl_packed" and not _mkl_packable()):
                return torch.nn.functional.linear(x, w, bias)
            if kernel == "mkl_packed":
                return self._mkl_linear(x, tuned)
            if kernel == "rows" and rows == s:                 # one GEMV per row
                return torch.cat([torch.nn.functional.linear(x[..., i:i + 1, :], w, bias)
                                  for i in range(s)], -2)
            two = _pad_rows(x, 2).reshape(-1, w.shape[1])                      # [2+, K]
            y = (w @ two.t()).t()[:rows].contiguous()                          # [rows, N]
            y = y if bias is None else y + bias
            return y.reshape(*x.shape[:-1], w.shape[0])
        key = self._weight_key()
        if key != self.packed_key:
            self.packed, self.packed_key = torch.ops.mkldnn._reorder_linear_weight(w.detach()), key
        if rows > _ONEDNN_MAX_ROWS and self.batch_invariant and rows == s:   # 32 at a time
            return torch.cat([self(x[..., i:i + _ONEDNN_MAX_ROWS, :])
                              for i in range(0, s, _ONEDNN_MAX_ROWS)], -2)
        if rows < _ONEDNN_MIN_ROWS and self.batch_invariant:
            x = _pad_rows(x, _ONEDNN_MIN_ROWS)                                 # [.., 4, K]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")[
            ..., :s, :]


FEW_ROW_KERNELS = ("mkl", "onednn", "linear", "rows", "mkl_packed")
TUNED_ROWS = (1, 2, 3, 4, 8, 16)  # row counts tune_few_row_kernels times (verifies of depth 0-15;
                                  # the counts between take the next one's kernel)


@torch.inference_mode()
def tune_few_row_kernels(model, context: int = 128, reps: int = 5) -> dict[int, str]:
    """Which kernel runs the fp32 linears of `model` (FewRowLinear, not batch invariant) for
    each row count of TUNED_ROWS: MKL's W @ x^T, oneDNN with the packed weight, F.linear, one
    F.linear GEMV per row, or MKL's sgemm with a weight packed for that row count, each timed
    on whole forwards of that many tokens after a `context`-token cache (interleaved, median of
    `reps`), the fastest kept per row count (the MKL packs of the others are dropped). It
    depends on the host: MKL's W @ x^T was fastest for 1-2 rows on the AMD EPYC the defaults
    were measured on, and on a Xeon capped at AVX2 it made a 1-token forward x2.1 slower than
    F.linear (75 against 36 ms). -> {rows: kernel}; {} when nothing to tune (bf16, GPU, batch
    invariant)."""
    from transformers import DynamicCache
    few = [m.forward for m in model.modules() if isinstance(m, torch.nn.Linear)
           and isinstance(m.forward, FewRowLinear) and not m.forward.batch_invariant]
    p = next(model.parameters())
    if not few or p.dtype != torch.float32 or p.device.type != "cpu":
        return {}
    cache = DynamicCache()
    model(input_ids=torch.arange(context)[None] % model.config.get_text_config(decoder=True).vocab_size, cache=cache,
          use_cache=True)
    chosen = {}
    for rows in TUNED_ROWS:
        x = torch.full((1, rows), 7)
        few_only = {"rows"} if rows == 1 else {"rows", "mkl"} if rows > 4 else set()
        kernels = [k for k in FEW_ROW_KERNELS if k not in few_only      # GEMVs / W @ x^T: 1-4 rows
                   and (k != "mkl_packed" or _mkl_packable())]
        times = {k: [] for k in kernels}
        for _ in range(reps + 1):                                   # the first: warm-up
            for kernel in kernels:
                for f in few:
                    f.few[rows] = kernel
                t0 = time.perf_counter()
                model(input_ids=x, cache=cache, use_cache=True)
                times[kernel].append(time.perf_counter() - t0)
                cache.crop(-rows)
        chosen[rows] = min(kernels, key=lambda k: sorted(times[k][1:])[reps // 2])
        for f in few:
            f.few[rows] = chosen[rows]
            if chosen[rows] != "mkl_packed":
                f.mkl_packed.pop(rows, None)                        # its memory back
    return chosen


def use_few_row_kernels(model, batch_invariant: bool = False,
                        kernels: dict[int, str] | None = None) -> None:
    """Route every nn.Linear of `model` through FewRowLinear (for inference: a decoder's decode
    steps and speculative verifies, a drafter's steps). kernels: {rows: kernel} for fp32 few-row
    calls (tune_few_row_kernels of another model; default: MKL for 1-2 rows, oneDNN above).
    The packed copies of the weights cost their memory once more."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = FewRowLinear(m, batch_invariant)
            m.forward.few = dict(kernels or {})


TREE_ATTENTION = "eagle3_tree"


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   tree=None, **kwargs):
    """SDPA, and for a tree verify (tree_layout) each path as a chain (_tree_attention): what a
    verifier without batch invariance runs. On CPU the grouped KV heads are read in place
    (enable_gqa): transformers' SDPA copies them out per query head whenever it is given a mask,
    i.e. in every verify of 2+ tokens (an emulated-AVX2 Xeon: a 2 / 8-token fp32 verify of
    SmolLM2 46.5 / 57 ms with the copies, 42.7 / 52 without)."""
    if tree is not None:
        return _tree_attention(module, query, key, value, scaling, tree)
    if not query.is_cpu or dropout:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, :key.shape[-2]]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True,
        is_causal=attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal",
                                                                           True))
    return out.transpose(1, 2).contiguous(), None


def allow_trees(model) -> None:
    """Let `model` verify speculative trees (tree_layout) with SDPA for everything else; a
    batch-invariant model (make_batch_invariant) takes trees already."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    if model.config._attn_implementation != INVARIANT_ATTENTION:
        AttentionInterface.register(TREE_ATTENTION, tree_attention)
        AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)    # SDPA's causal masks
        model.set_attn_implementation(TREE_ATTENTION)


def moe_blocks(model) -> list[torch.nn.Module]:
    """The mixture-of-experts blocks of `model`, found by structure: modules with a router
    (`gate`) and `experts` (DeepSeek-V3 / Kimi-K2.5, Qwen-MoE, Mixtral in transformers)."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


class PerTokenMoE:
    """The forward of one MoE block (moe_blocks) that routes and computes each token on its
    own, exactly as a one-token forward does: transformers' MoE routes all rows with one
    F.linear and runs each hit expert once over the tokens routed to it, so a token's
    experts see a row count (GEMV or GEMM, the kernels' blocking) set by how many tokens the
    forward carries and which of them chose the same expert. Per token, a verify of k tokens
    makes k calls of the block's own forward, each what decoding that token runs: batch
    invariant by construction, on any device and kernel (the router in fp32, the experts'
    3-D weights and their transformers experts implementation included). A prefill (nothing
    cached: `state["prefill"]`, set by a hook on the decoder) is shared by every path and
    stays batched: per token it cost x18 (60 tokens, deepseek_verifier, fp32, 1 thread)."""

    def __init__(self, block: torch.nn.Module, state: dict):
        self.block, self.state = block, state

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        forward = type(self.block).forward                    # the block's own
        h = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, 1, 1, h)                              # [n, 1, 1, H]
        if len(tokens) == 1 or self.state["prefill"]:
            return forward(self.block, hidden_states)
        return torch.cat([forward(self.block, t) for t in tokens]).reshape(
            hidden_states.shape)                                                 # [.., H]


def _per_token_moe(model) -> None:
    """Route `model`'s MoE blocks through PerTokenMoE (once), with a decoder hook that tells
    them whether a forward is a prefill (no cache, or an empty one)."""
    blocks = [b for b in moe_blocks(model) if not isinstance(b.forward, PerTokenMoE)]
    if not blocks:
        return
    state = {"prefill": True}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    decoder.register_forward_pre_hook(functools.partial(_note_prefill, state), with_kwargs=True)
    for block in blocks:
        block.forward = PerTokenMoE(block, state)


def _note_prefill(state: dict, module, args, kwargs) -> None:
    """A decoder's forward pre-hook: state["prefill"] = whether this forward has nothing cached
    (transformers passes the cache as `cache`, formerly `past_key_values`)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    state["prefill"] = cache is None or cache.get_seq_length() == 0


def make_batch_invariant(model) -> None:
    """Make a batch-1 decoder's per-token outputs independent of how many tokens a forward
    carries, so speculative verification (d+1 tokens) computes bit for bit what plain decoding
    (1 token) does: attention (batch_invariant_attention, MLA's value head size too), linears
    (FewRowLinear) and MoE blocks (PerTokenMoE). Needed for exact greedy equality in
    bf16/fp16; fp32 rounding differences are ~1e-7 and stay below argmax ties in practice on
    dense models (an MoE router's top-k can flip on them). Measured on a 2-core AVX512-BF16 CPU
    (SmolLM2, bf16, 1 thread): see eagle3_ray/bench/verify_cost.py."""
    from transformers import AttentionInterface
    AttentionInterface.register(INVARIANT_ATTENTION, batch_invariant_attention)
    model.set_attn_implementation(INVARIANT_ATTENTION)
    use_few_row_kernels(model, batch_invariant=True)
    _per_token_moe(model)
