"""The leaderboard's rows, suites and hypotheses (`python scripts/leaderboard.py`; the cells and
the report: torchtitan_ext/eval/leaderboard_cells.py, torchtitan_ext/eval/leaderboard.py).

A row is one family or graft: how it trains (a train config, from scratch or from the in-house
backbone's Hugging Face folder; none for the frozen backbone and the test-time methods) and how
it reads past its training context:
- "streaming": segment by segment with the memory state carried (Titans, Mela, and the grafts,
  whose stream carries key / value caches as well as their memories);
- "full": the whole text in one pass (Transformer++ with full attention, the MLP-FFN LM);
- "sliding": each token sees the last `window` tokens (the window-only controls);
- "write_read" (grafted GradMem and its forward-WRITE twin, whose rows hold [context; query]
  with positions restarting at the query: models/grafts/gradmem.py): a recall prompt's context
  is written into the memory (K gradient steps, or K forward writes, each one pass over the
  whole context: at 2x-8x the window, positions past the backbone's) and its question read
  after the memory at positions from 0, never seeing the context (tasks.py `answer` with the
  question as a new segment: GradMem's own protocol); perplexity reads the document in segments
  of `window` tokens, each after a memory written from every token before it (the first after
  the meta-learned M_0), positions restarting at each segment (leaderboard_cells.py
  `write_read_logits`).
- "bounded_stream" (the grafts and their controls, added after the second graft run): a stream
  whose every block attends to the last `window` tokens only (`DecoderLM.stream` with
  `stream_window`: sliding-window attention, its key / value caches cut), a memory carrying
  what falls out: past the backbone's window, attention at the distances it was trained on,
  like for like between a graft and its controls. Such a row reads the trained cells of the
  row it names in `runs_of` (the same checkpoints), so it trains nothing of its own.
torchtitan's llama3 has no sliding-window attention mask (its FlexAttention masks are causal,
per document or block-causal), so the window-only Transformer++ is the same model trained on
`window`-token sequences (as many tokens per step: a batch `seq_len / window` times larger)
and read with long_ppl's sliding window of `window` tokens; in the recall tasks it sees the
prompt's last `window` tokens. The frozen backbone and the LoRA-only control read the same way.
"test_time" rows are whole_book.py methods on the frozen backbone (chunks of half a window
read in a window, each scored then learned from); a recall prompt is read so, whole, and
answered by the model that learned from it through the backbone's sliding window.
The grafts train from the backbone's Hugging Face folder on their configs' data: in the cpu
suite LoRA-only, MemoryLlama and MoNe continue on the backbone's own pretraining mix (text and
S-NIAH rows inside its window; train_configs/leaderboard.py `on_backbone_mix`), in the ci suite
the debug configs' embedded corpus; GradMem and its twin train on KV-retrieval rows of
[context | query] (train_configs.gradmem: `gradmem_qwen3_debug_tasks`,
`gradmem_qwen3_debug_forward_tasks`, the twin's LoRA rank raised so that both train as many
parameters within 1%).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_ext.errors import UserError

WINDOW_MULTIPLES = (1, 2, 4, 8)  # recall lengths, in windows
LENGTH_MULTIPLES = (1, 2, 4, 8)  # perplexity lengths, in training contexts
RECALL_TASKS = ("s_niah", "mk_niah", "kv_retrieval")
BABILONG_TASKS = ("qa1", "qa2", "qa3", "qa4", "qa5")


@dataclass(frozen=True)
class Row:
    """One family or graft. config: "module:function" (the frozen backbone and the test-time
    rows: the backbone's, for loading); kind: scratch | graft | backbone | test_time; mode:
    streaming | full | sliding | write_read | bounded_stream (module docstring); method: the
    whole_book.py spec of a test_time row; windowed: trained on window-token sequences (the
    window-only control); runs_of: the row whose trained cells this one reads ("": its own)."""

    name: str
    config: str
    kind: str
    mode: str
    method: str = ""
    windowed: bool = False
    runs_of: str = ""

    @property
    def runs_name(self) -> str:
        """The name of the row that trains this row's checkpoints."""
        return self.runs_of or self.name


SCRATCH_MODES = {"transformer_full": "full", "transformer_window": "sliding", "titans_mac": "streaming",
                 "titans_mac_inputs": "streaming", "titans_mag": "streaming", "titans_mal": "streaming", "titans_lmm": "streaming", "mela": "streaming",
                 "mela_memory_off": "streaming", "mlp_lm": "full"}


def scratch_rows(configs: dict[str, str]) -> tuple[Row, ...]:
    """The from-scratch rows, {row name: "module:function"} (SCRATCH_MODES' names)."""
    return tuple(Row(name, configs[name], "scratch", mode, windowed=name == "transformer_window")
                 for name, mode in SCRATCH_MODES.items())


TITANS = ("mac", "mag", "mal", "lmm")
DEBUG_SCRATCH = {"transformer_full": "train_configs.transformer:transformer_debug",
                 "transformer_window": "train_configs.transformer:transformer_debug",
                 **{f"titans_{v}": f"train_configs.titans:titans_{v}_debug" for v in TITANS},
                 "titans_mac_inputs": "train_configs.leaderboard:titans_mac_inputs_debug",
                 "mela": "train_configs.mela:mela_debug", "mela_memory_off": "train_configs.leaderboard:mela_debug_memory_off",
                 "mlp_lm": "train_configs.mlp_lm:mlp_lm_debug"}
CPU_SCRATCH = {"transformer_full": "train_configs.leaderboard:transformer_cpu",
               "transformer_window": "train_configs.leaderboard:transformer_cpu",
               **{f"titans_{v}": f"train_configs.leaderboard:titans_{v}_cpu" for v in TITANS},
               "titans_mac_inputs": "train_configs.leaderboard:titans_mac_inputs_cpu",
               "mela": "train_configs.mela:mela_debug", "mela_memory_off": "train_configs.leaderboard:mela_debug_memory_off",
               "mlp_lm": "train_configs.leaderboard:mlp_lm_cpu"}
BACKBONE_CONFIG = "train_configs.backbone:backbone_qwen3_pretrain"
# Read again as bounded streams (and the frozen backbone): the trained grafts whose attention
# reaches past the backbone's window when streamed (MoNe's never does: it is its own bound).
BOUNDED_GRAFTS = ("lora_only", "memoryllama_alma", "memoryllama_gema")
GRAFT_MODES = {"backbone_frozen": "sliding", "lora_only": "sliding", "memoryllama_alma": "streaming",
               "memoryllama_gema": "streaming", "mone": "streaming", "gradmem": "write_read",
               "gradmem_forward": "write_read"}


def graft_rows(configs: dict[str, str]) -> tuple[Row, ...]:
    """The frozen backbone, the trained grafts {row name: "module:function"} (GRAFT_MODES'
    names but the backbone) and the test-time methods on the backbone."""
    trained = tuple(Row(name, configs[name], "graft", mode) for name, mode in GRAFT_MODES.items()
                    if name != "backbone_frozen")
    bounded = tuple(Row(f"{name}_bounded", configs[name], "graft", "bounded_stream", runs_of=name)
                    for name in BOUNDED_GRAFTS)
    return (Row("backbone_frozen", BACKBONE_CONFIG, "backbone", "sliding"), *trained,
            Row("locas_glu", BACKBONE_CONFIG, "test_time", "sliding", method="locas_glu"),
            Row("templora", BACKBONE_CONFIG, "test_time", "sliding", method="templora"),
            Row("backbone_frozen_bounded", BACKBONE_CONFIG, "backbone", "bounded_stream"), *bounded)


GRADMEM_GRAFTS = {"gradmem": "train_configs.gradmem:gradmem_qwen3_debug_tasks",
                  "gradmem_forward": "train_configs.gradmem:gradmem_qwen3_debug_forward_tasks"}
DEBUG_GRAFTS = {"lora_only": "train_configs.backbone:backbone_qwen3_debug_lora",
                "memoryllama_alma": "train_configs.backbone:memoryllama_alma_debug",
                "memoryllama_gema": "train_configs.backbone:memoryllama_gema_debug",
                "mone": "train_configs.backbone:mone_debug", **GRADMEM_GRAFTS}
# the cpu suite's: equal trainable parameters (train_configs/leaderboard.py)
CPU_GRAFTS = {"lora_only": "train_configs.leaderboard:lora_only_cpu",
              "memoryllama_alma": "train_configs.leaderboard:memoryllama_alma_cpu",
              "memoryllama_gema": "train_configs.leaderboard:memoryllama_gema_cpu",
              "mone": "train_configs.leaderboard:mone_cpu", **GRADMEM_GRAFTS}
DEBUG_ROWS = scratch_rows(DEBUG_SCRATCH) + graft_rows(DEBUG_GRAFTS)
# The paper suite: the 400M row of each from-scratch family (MLP-FFN LM: its one paper size),
# FineWeb-Edu, 5B tokens. The grafts' paper configs start from Llama-3.2-1B's Hugging Face
# folder (README "Grafting"), which preflight requires on disk, so they are no row of it.
PAPER_CONFIGS = {
    "transformer_full": "train_configs.transformer:transformer_400m",
    "transformer_window": "train_configs.transformer:transformer_400m",
    **{f"titans_{v}": f"train_configs.titans:titans_{v}_400m" for v in TITANS},
    "mela": "train_configs.mela:mela_400m",
    "mela_memory_off": "train_configs.leaderboard:mela_400m_memory_off",
    "mlp_lm": "train_configs.mlp_lm:mlp_lm_600m",
}


@dataclass(frozen=True)
class Suite:
    """One leaderboard size. seq_len: training context of the scratch rows (the grafts keep
    their configs'); window: the memory models' window (Titans' attention window; in ci and cpu
    also Mela's P*C), the window-only controls' span and the unit of the recall lengths;
    graft_window: the same for the grafts (the backbone's native context, its sliding window); steps,
    local_batch: each training row's (equal training tokens); seeds; ppl_docs: held-out
    documents of 8x seq_len; recall_samples: prompts per task and length; answer_tokens: greedy
    tokens per answer; overlap: train the next cell while one is evaluated (ci, cpu: speed over
    cost figures taken alone); backbone_steps: the backbone's pretraining (None: scripts/pretrain_backbone.sh's
    default; 0: the paper suite, which has no graft row); zero_shot_items: questions of the local
zero-shot task each cell's Hugging Face export answers through lm-eval (torchtitan_ext/eval/zero_shot.py;
0: none, the paper suite, whose list is zero_shot.PAPER_TASKS on the Hub)."""

    name: str
    rows: tuple[Row, ...]
    seq_len: int
    window: int
    graft_window: int
    steps: int
    local_batch: int
    seeds: tuple[int, ...]
    ppl_docs: int
    recall_samples: int
    backbone_steps: int | None
    zero_shot_items: int = 0
    answer_tokens: int = 8
    overlap: bool = False
    paper_configs: dict = field(default_factory=dict, hash=False, compare=False)

    def ppl_lengths(self) -> list[int]:
        return [self.seq_len * k for k in LENGTH_MULTIPLES]

    def window_of(self, row: Row) -> int:
        """The span a row's memory must reach past: the scratch rows' window, or the grafts'
        backbone's native context."""
        return self.window if row.kind == "scratch" else self.graft_window

    def recall_lengths(self, row: Row) -> list[int]:
        return [self.window_of(row) * k for k in WINDOW_MULTIPLES]

    def training_tokens(self) -> int:
        return self.steps * self.local_batch * self.seq_len


SUITES = {
    "ci": Suite("ci", DEBUG_ROWS, seq_len=128, window=64, graft_window=64, steps=3, local_batch=2, seeds=(0,), ppl_docs=2,
                recall_samples=1, backbone_steps=10, zero_shot_items=4, answer_tokens=4, overlap=True),
    # About 3 minutes a trained cell on 2 cores (69 cells; the 12 bounded-stream reads of trained
    # runs take under a minute each): 123K training tokens a row. Training and
    # evaluation each take one thread (OMP_NUM_THREADS=1), so with overlap the next cell trains
    # on one core while the last is evaluated on the other: each cost figure is taken on its own
    # core beside the other process, not on an idle machine.
    "cpu": Suite("cpu", scratch_rows(CPU_SCRATCH) + graft_rows(CPU_GRAFTS), seq_len=128, window=64, graft_window=256, steps=60,
                 local_batch=16,
                 seeds=(0, 1, 2), ppl_docs=4, recall_samples=5, backbone_steps=None, zero_shot_items=64, overlap=True),
    "paper": Suite("paper", tuple(r for r in DEBUG_ROWS if r.name in PAPER_CONFIGS), seq_len=4096, window=512, graft_window=0,
                   steps=5 * 10**9 // 2**19, local_batch=8, seeds=(0,), ppl_docs=100, recall_samples=100,
                   backbone_steps=0, paper_configs=PAPER_CONFIGS),
}


@dataclass(frozen=True)
class Hypothesis:
    """A claim written before any run. Each comparison (model row, control row, metric, sense)
    gives a paired interval: metric "recall_beyond" (exact-match difference beyond the window,
    lengths 2x-8x), "recall_inside" (at 1x), "ppl_past" (perplexity ratio past the training
    length), "ppl_inside" (ratio inside it), "eval_cost" (eval tokens/s ratio, model / control);
    sense "better" (model ahead) or "match" (within MATCH_TOLERANCE)."""

    claim: str
    comparisons: tuple[tuple[str, str, str, str], ...]


MATCH_TOLERANCE = {"recall_inside": 0.05, "recall_beyond": 0.05, "ppl_inside": 0.05, "ppl_past": 0.05}
HYPOTHESES = (
    Hypothesis("Titans MAC beats window-only beyond the window",
               (("titans_mac", "transformer_window", "recall_beyond", "better"),
                ("titans_mac", "transformer_window", "ppl_past", "better"))),
    # Added 2026-11-28 (issue 48: perplexity beside recall), before any cell of the row ran.
    Hypothesis("MAC writing its segment's inputs, the MQAR recall winner over the paper's MAC (H9), pays no "
               "perplexity for it: it matches the paper's MAC inside and past the training length",
               (("titans_mac_inputs", "titans_mac", "ppl_inside", "match"),
                ("titans_mac_inputs", "titans_mac", "ppl_past", "match"))),
    # Added 2026-11-29T05:09Z (issue 48, goal 6), before any cell of the batch ran. Expected: within 5% of the
    # Transformer++ inside the trained length (MAG and MAL add the memory to a windowed attention; LMM has the
    # memory alone), ahead past it (the Transformer++ extrapolates RoPE; the Titans rows read a window or a state
    # of the same size at any length).
    Hypothesis("The Titans memories that learned MQAR recall against window-only attention (LMM, MAG, MAL) pay no "
               "perplexity for it: they match the Transformer++ inside the training length and beat it past it",
               tuple((model, "transformer_full", metric, sense)
                     for model in ("titans_lmm", "titans_mag", "titans_mal")
                     for metric, sense in (("ppl_inside", "match"), ("ppl_past", "better")))),
    Hypothesis("Mela beats its memory-off twin and Transformer++ past the training length",
               (("mela", "mela_memory_off", "ppl_past", "better"), ("mela", "transformer_full", "ppl_past", "better"))),
    Hypothesis("MoNe and MemoryLlama beat the LoRA-only control and the frozen backbone beyond the window, "
               "and match them inside",
               tuple((model, control, metric, sense)
                     for model in ("mone", "memoryllama_alma", "memoryllama_gema")
                     for control in ("lora_only", "backbone_frozen")
                     for metric, sense in (("recall_beyond", "better"), ("recall_inside", "match")))),
    Hypothesis("The GradMem gradient WRITE beats the forward WRITE",
               (("gradmem", "gradmem_forward", "recall_beyond", "better"),)),
    Hypothesis("Locas-GLU matches TempLoRA at lower cost",
               (("locas_glu", "templora", "ppl_past", "match"), ("locas_glu", "templora", "eval_cost", "better"))),
    # Added before the second graft run (docs/leaderboard.md): not a paper's claim but the
    # condition under which the MoNe / MemoryLlama hypothesis's nulls are about the memories, not the fine-tuning.
    Hypothesis("Recipe check: the grafts' fine-tuning keeps the backbone's in-window recall "
               "(LoRA-only matches the frozen backbone inside the window)",
               (("lora_only", "backbone_frozen", "recall_inside", "match"),)),
)


# Comparisons added after a run (not written before it, so never a verdict on a paper's claim):
# the grafts read like for like with their controls as bounded streams (docs/leaderboard.md,
# "Second graft run"). Same intervals and verdict rule as HYPOTHESES.
EXPLORATORY = (
    Hypothesis("Read as bounded streams, MemoryLlama beats the LoRA-only control and the frozen backbone beyond "
               "the window, and matches them inside",
               tuple((f"{model}_bounded", control, metric, sense)
                     for model in ("memoryllama_alma", "memoryllama_gema")
                     for control in ("lora_only_bounded", "backbone_frozen_bounded")
                     for metric, sense in (("recall_beyond", "better"), ("recall_inside", "match")))),
    Hypothesis("The frozen backbone recalls as well read as a bounded stream as read by its sliding window",
               (("backbone_frozen_bounded", "backbone_frozen", "recall_beyond", "match"),
                ("backbone_frozen_bounded", "backbone_frozen", "recall_inside", "match"))),
)


def suite(name: str) -> Suite:
    if name not in SUITES:
        raise UserError(f"unknown suite '{name}': choose from {', '.join(SUITES)}")
    return SUITES[name]


def select_rows(chosen: Suite, names: str | None) -> tuple[Row, ...]:
    """The suite's rows named in the comma-separated `names` (all when None); UserError on a
    name that is no row of the suite."""
    if not names:
        return chosen.rows
    known = {r.name: r for r in chosen.rows}
    wanted = names.split(",")
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise UserError(f"unknown row(s) {unknown} in suite {chosen.name}: choose from {', '.join(known)}")
    return tuple(known[n] for n in wanted)
