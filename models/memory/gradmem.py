"""GradMem (paper 001, Kuratov et al., "GradMem: learning to write context into memory with
test-time gradient descent"): m prefix vectors written by K steps of gradient descent on a
context-reconstruction loss, then read as the prefix of the query; the context itself is
never seen by the read.

Section 2.1 and appendix C, with the authors' public code's choices where the paper is silent:
- Memory M in R^{m x d}: a meta-learned initialisation M_0 ~ N(0, 0.02), copied per sample.
  The memory is float32 whatever the model's dtype (it is cast to the embeddings' dtype when
  prepended).
- WRITE, eq. (1) by gradient descent: M_{k+1} = M_k - alpha grad_M L_write(M_k; C), k < K, with
  L_write(M; C) = mean_i -log f(c_i | [P(M); c_<i]) over the sample's N context tokens (the last
  memory slot predicts c_1). The paper writes a sum; the per-sample mean (the public code's)
  keeps alpha independent of the context length. The samples' losses are summed before the
  gradient, so each sample's memory is its own (batch-independent).
- P: an optional learned d x d linear map on the memory (identity weight, zero bias), in WRITE
  and READ (appendix C; off in the public KV-retrieval runs, so off by default).
- WRITE head: the write loss's logits come from W_lm + Delta with Delta zero-initialised: a
  separate head "initialised from the LM head" (appendix C) that stays so when a pretrained
  head is loaded over the init (a copy taken at init would hold the random head). Where the LM
  head trains too (from scratch) the write head follows it, plus its own Delta.
- READ, eq. (2): [P(M_K); query tokens] from position 0 -> their final-normed hidden states.
- Meta-learning (`meta_gradient`, the public code's `grad_mode`): "second" (default, section 2.1
  and appendix A "we backpropagate through the WRITE optimization"): with gradients enabled
  the inner gradients keep their graph (create_graph), so the outer loss reaches theta and M_0
  through all K steps. "first" (first-order, FOMAML; appendix A: "first-order approximations
  were not sufficient", the reading taken here of Table 1's "w/o meta-learning" rows): each
  inner gradient is detached, M_K = M_0 - alpha sum_k stopgrad(g_k), so the outer gradient
  reaches M_0 through the identity path only and theta through the read (and the write-loss
  term) only. "none" (the public code's other mode): M_0 is detached too and gets no outer
  gradient. With gradients off (evaluation) the write differentiates the reconstruction loss
  w.r.t. the memory, and nothing else, whatever the mode.
- Forward WRITE (the paper's RMT baseline, Table 1): M_{k+1} = the final-normed hidden states
  of the m trailing memory tokens of [P(M_k); C; P(M_k)] (their positions follow each row's
  context); K forward writes are the table's "xK memory updates".
- The write runs SDPA's math backend: the fused kernels (CPU flash, CUDA flash / flex) have no
  double backward. The read is differentiated once and keeps the fast kernels.

Host model: `tok_embeddings`, `decode(embeddings, rope_positions)` (the blocks and the final
norm) and `lm_head` (`models/grafts/gradmem.py`'s `GradMemLM`, which builds this memory through
the "gradmem" row of models/grafts/graft.py's graft table; `gradmem_flops` below is the
row's FLOP count: training FLOPs per token of the whole LM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel, SDPBackend

from models.layers.flops import attention_span, decoder_block_linears, linear, lora, TRAIN

WRITES = ("gradient", "forward")
META_GRADIENTS = ("second", "first", "none")


@dataclass
class GradMemConfig:
    n_mem: int = 8  # m: memory vectors (Table 4: 8 for KV-retrieval)
    write_steps: int = 2  # K: gradient steps (or forward writes) per context
    inner_lr: float = 0.04  # alpha (the public KV-retrieval runs: K = 2, alpha = 0.04)
    write: str = "gradient"  # "gradient" (GradMem) | "forward" (the RMT baseline)
    memory_projection: bool = False  # P, appendix C (i)
    write_head: bool = True  # a separate WRITE head, appendix C (ii)
    init_std: float = 0.02  # M_0 ~ N(0, init_std)
    meta_gradient: str = "second"  # "second" | "first" (Table 1's "w/o meta-learning") | "none" (module docstring)

    def __post_init__(self):
        if self.write not in WRITES:
            raise ValueError(f"GradMem write '{self.write}' unknown: choose one of {WRITES}")
        if self.meta_gradient not in META_GRADIENTS:
            raise ValueError(f"GradMem meta_gradient '{self.meta_gradient}' unknown: choose one of {META_GRADIENTS}")
        if self.n_mem < 1:
            raise ValueError(f"GradMem n_mem {self.n_mem}: the memory needs at least one vector (m >= 1)")
        if self.write_steps < 1:
            raise ValueError(f"GradMem write_steps {self.write_steps}: the WRITE needs at least one step (K >= 1)")
        if self.write == "gradient" and not self.inner_lr > 0:
            raise ValueError(f"GradMem inner_lr {self.inner_lr}: the WRITE step size alpha must be positive")


def _state(x: torch.Tensor) -> torch.Tensor:
    """x as memory state: float32, or float64 when x is (exactness checks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _positions(batch: int, length: int, device) -> torch.Tensor:
    return torch.arange(length, device=device).expand(batch, length)


class GradMem(nn.Module):
    """The memory's learned pieces (M_0, P, the WRITE head's Delta) and its WRITE / READ
    (module docstring); the host model is passed to each call."""

    def __init__(self, dim: int, vocab_size: int, cfg: GradMemConfig):
        super().__init__()
        self.cfg = cfg
        self.memory_init = nn.Parameter(torch.empty(cfg.n_mem, dim))
        self.memory_proj = nn.Linear(dim, dim) if cfg.memory_projection else None
        uses_head = cfg.write_head and cfg.write == "gradient"
        self.memory_write_head = nn.Parameter(torch.empty(vocab_size, dim)) if uses_head else None
        self.last_stats: dict[str, torch.Tensor] = {}  # of the last write (`_record`)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """M_0 ~ N(0, init_std), P = identity (zero bias), Delta = 0."""
        with torch.no_grad():
            nn.init.normal_(self.memory_init, std=self.cfg.init_std)
            if self.memory_proj is not None:
                nn.init.eye_(self.memory_proj.weight)
                nn.init.zeros_(self.memory_proj.bias)
            if self.memory_write_head is not None:
                nn.init.zeros_(self.memory_write_head)

    def initial(self, batch: int) -> torch.Tensor:
        """M_0 for `batch` samples: (batch, m, d), float32."""
        return _state(self.memory_init).expand(batch, -1, -1)

    def prefix(self, memory: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """P(M) as input embeddings: memory (B, m, d) float32 -> (B, m, d) in `dtype`."""
        x = memory.to(dtype)
        return self.memory_proj(x) if self.memory_proj is not None else x

    def reconstruction_loss(self, host, memory: torch.Tensor, context: torch.Tensor, lengths: torch.Tensor,
                            context_emb: torch.Tensor | None = None) -> torch.Tensor:
        """L_write(M; C) per sample: memory (B, m, d), context (B, N) token ids right-padded
        past `lengths` (B,) -> (B,) float32 mean NLL of each sample's context tokens under the
        WRITE head. `context_emb`: the context's embeddings when already computed."""
        batch, n = context.shape
        m = memory.shape[1]
        emb = host.tok_embeddings(context) if context_emb is None else context_emb
        h = host.decode(torch.cat([self.prefix(memory, emb.dtype), emb], 1), _positions(batch, m + n, emb.device))
        h = h[:, m - 1 : m + n - 1]
        logits = host.lm_head(h)
        if self.memory_write_head is not None:
            logits = logits + F.linear(h, self.memory_write_head.to(h.dtype))
        nll = F.cross_entropy(_state(logits).transpose(1, 2), context, reduction="none")
        valid = (torch.arange(n, device=context.device) < lengths[:, None]).float()
        return (nll * valid).sum(1) / valid.sum(1)

    def write(self, host, context: torch.Tensor, lengths: torch.Tensor,
              steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """WRITE, eq. (1): context (B, N) right-padded past `lengths` (B,) -> (M_K (B, m, d)
        float32, the write losses L_write(M_k; C) of the gradient steps k = 0..K-1 (K, B);
        (0, B) for the forward write). `steps`: K for this call (default the config's)."""
        steps = steps or self.cfg.write_steps
        emb = host.tok_embeddings(context)
        initial = self.initial(context.shape[0])
        with sdpa_kernel([SDPBackend.MATH]):
            if self.cfg.write == "forward":
                memory = self._forward_write(host, initial, emb, lengths, steps)
                losses = emb.new_zeros(0, len(context)).float()
            else:
                memory, losses = self._gradient_write(host, initial, emb, context, lengths, steps)
        self._record(initial, memory, losses)
        return memory, losses

    def _record(self, initial: torch.Tensor, memory: torch.Tensor, losses: torch.Tensor) -> None:
        """`last_stats` of this write (detached, batch means): update_ratio = |M_K - M_0| / |M_0|
        per sample (Frobenius); write_loss_first / write_loss_last = L_write(M_0) and
        L_write(M_{K-1}) of the gradient steps."""
        with torch.no_grad():
            change = (memory - initial).flatten(1).norm(dim=1) / initial.flatten(1).norm(dim=1)
            self.last_stats = {"update_ratio": change.mean()}
            if losses.shape[0]:
                self.last_stats |= {"write_loss_first": losses[0].mean(), "write_loss_last": losses[-1].mean()}

    def _gradient_write(self, host, memory, emb, context, lengths, steps):
        """K gradient steps (module docstring, "Meta-learning"). Under "first" / "none" only the
        last step's graph is kept (the outer loss reads L_write(M_{K-1})); the earlier losses
        are returned detached."""
        meta_learning = torch.is_grad_enabled()
        second_order = meta_learning and self.cfg.meta_gradient == "second"
        losses = []
        with torch.enable_grad():
            if not meta_learning:
                emb = emb.detach()
            if not meta_learning or self.cfg.meta_gradient == "none":
                memory = memory.detach().clone().requires_grad_()
            for k in range(steps):
                loss = self.reconstruction_loss(host, memory, context, lengths, emb)
                kept = second_order or (meta_learning and k == steps - 1)
                (grad,) = torch.autograd.grad(loss.sum(), memory, create_graph=second_order, retain_graph=kept)
                memory = memory - self.cfg.inner_lr * grad
                if not meta_learning:
                    memory = memory.detach().requires_grad_()
                losses.append(loss if kept else loss.detach())
        return (memory if meta_learning else memory.detach()), torch.stack(losses)

    def _forward_write(self, host, memory, emb, lengths, steps):
        batch, n, dim = emb.shape
        m = memory.shape[1]
        rows = torch.arange(batch, device=emb.device)[:, None].expand(batch, m)
        slots = (m + lengths)[:, None] + torch.arange(m, device=emb.device)  # (B, m): right after each context
        for _ in range(steps):
            p = self.prefix(memory, emb.dtype)
            x = torch.cat([p, emb, p.new_zeros(batch, m, dim)], 1).index_put((rows, slots), p)
            h = host.decode(x, _positions(batch, n + 2 * m, emb.device))
            memory = _state(h.gather(1, slots[..., None].expand(-1, -1, dim)))
        return memory

    def read(self, host, memory: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """READ, eq. (2): memory (B, m, d), tokens (B, R) (query, answer) -> final-normed
        hidden states of the tokens (B, R, d), positions from 0 at the memory."""
        emb = host.tok_embeddings(tokens)
        m = memory.shape[1]
        h = host.decode(torch.cat([self.prefix(memory, emb.dtype), emb], 1),
                        _positions(tokens.shape[0], m + tokens.shape[1], emb.device))
        return h[:, m:]


def gradmem_diagnostics(model: nn.Module) -> dict[str, float]:
    """`memory/gradmem/...`: the `last_stats` of the GradMem module's last write (found through wrappers)."""
    return {f"memory/gradmem/{key}": float(value) for module in model.modules() if isinstance(module, GradMem)
            for key, value in module.last_stats.items()}


def gradmem_flops(cfg, seq_len: int) -> float:
    """Training FLOPs per token of a GradMem LM (`models/grafts/gradmem.py`'s GradMemLMConfig)
    on rows of seq_len tokens, each taken as all context (`row_flops` with no read tokens: a
    KV row's query and answer are 9 of its 7n + 9 tokens)."""
    return row_flops(cfg, seq_len, 0)


def row_flops(cfg, context: int, read: int) -> float:
    """Per token of a row of `context` + `read` tokens: K WRITE steps over the context, the
    read over [M; read tokens], the head over the row. Per token through the backbone: linears
    `lin`, LoRA `lora`, attention over a span S `att(S)`, the head `head`; in a backward a
    trained linear counts 2 (activations and weights), a frozen one 1, attention 2.
    Gradient WRITE, per step over T = m + c tokens (c of them through the heads): the forward
    (1), the inner gradient w.r.t. the memory (activations only: 1 per linear and head, 2 per
    attention) and the outer backward through both (the forward's: 2 / 1 per linear, 2 per
    attention; the inner gradient's double backward, each of its products differentiated in
    both inputs: 2 / 1 per linear, 4 per attention); the WRITE head's Delta is trained.
    First-order writes (`meta_gradient` "first" / "none"): each step is the forward and the
    inner gradient only, and the outer backward runs through the last step's forward alone
    (the write-loss term; no double backward).
    Forward WRITE, per step over [M; C; M] (2m + c tokens): a trained forward + backward.
    The read trains as a plain step over its m + r tokens. The optional memory projection P
    (m x d x d per write, off in the KV runs) is not counted."""
    m, steps = cfg.gradmem.n_mem, cfg.gradmem.write_steps
    q = cfg.n_heads * cfg.head_dim
    trained = 2 if cfg.train_backbone else 1  # backward products of a backbone linear
    lin, adapters = cfg.n_layers * decoder_block_linears(cfg), lora(cfg)
    head = linear(cfg.dim, cfg.vocab_size)

    def att(span: float) -> float:
        return cfg.n_layers * attention_span(q, span)

    def plain_step(span: float) -> float:
        return (1 + trained) * lin + TRAIN * (adapters + att(span))

    if cfg.gradmem.write == "gradient":
        span = m + context
        write_head = head if cfg.gradmem.write_head else 0.0
        if cfg.gradmem.meta_gradient == "second":
            per_step = span * ((2 + 2 * trained) * lin + 6 * adapters + 9 * att(span)) + \
                context * ((2 + 2 * trained) * head + 6 * write_head)
        else:
            write_and_gradient = span * (2 * lin + 2 * adapters + 3 * att(span)) + context * (2 * head + 2 * write_head)
            last_backward = span * (trained * lin + 2 * adapters + 2 * att(span)) + context * (trained * head + 2 * write_head)
            per_step = write_and_gradient + last_backward / steps
    else:
        span = 2 * m + context
        per_step = span * plain_step(span)
    row = context + read
    return (steps * per_step + (m + read) * plain_step(m + read)) / row + (1 + trained) * head
