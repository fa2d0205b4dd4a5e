"""Where one training step's time goes on an H100, predicted on a CPU (torchtitan_ext/step_cost/).

    python scripts/step_cost.py --config titans_mac_400m [--seq-len 4096 --batch 2]
        [--mode eager|compiled|graphs | --compiled | --graphs] [--whole-sequence] [--fma-kernels] [--kernel-roofline] [--tf32]
        [--launch-floor-us US] [--sync-us 20] [--crude-launches]
        [--baseline transformer_400m|none] [--top 12]

Records one bench_models.py training step (bf16 autocast, fp32 parameters, cross-entropy, fused
AdamW) of CONFIG (<family>[_<variant>]_<flavor>, e.g. transformer_400m, mela_400m; or
name:flavor) on the meta device, costs every aten op on an H100 roofline plus a per-launch
floor (the mode's, `LAUNCH_S`), and prints the cost by op class, the predicted step time and
tokens/s, launches per memory layer, the top ops and model functions, the Transformer++ of the
same flavor in the same mode beside it, and the lease's measurement where one exists. In the
compiled modes the compiled regions' launches are also counted as Inductor's GPU scheduling emits
them (torchtitan_ext/step_cost/inductor_launches.py: the config's launch twin compiled and trained
one step on this CPU; minutes), and the step is predicted at that count too; `--crude-launches`
skips the count and keeps the crude fusion model's.
"""

from __future__ import annotations

import argparse
import sys

from torchtitan_ext.step_cost import HOST_SYNC_S, MODES, Hardware, baseline_of, predict, report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="e.g. titans_mac_400m, transformer_400m, mela_400m, mela:debug")
    p.add_argument("--seq-len", type=int, default=4096, help="fitted to the model as bench_models.py does")
    p.add_argument("--batch", type=int, default=2)
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--mode", choices=MODES, default="eager", help="compiled: as the family's training compiles "
                       "(crude fusion model), the rest eager; graphs: that, replayed as one CUDA graph")
    for mode in MODES:  # issue 47's commands: --compiled, --graphs
        if mode != "eager":
            modes.add_argument(f"--{mode}", dest="mode", action="store_const", const=mode, help=f"= --mode {mode}")
    p.add_argument("--whole-sequence", action="store_true", help="every neural memory on the whole-sequence kernels "
                   "(kernels/whole_sequence.py: one launch of batch x heads programs per layer and direction)")
    p.add_argument("--tf32", action="store_true", help="fp32 matmuls on TF32 tensor cores (default: fp32 peak, "
                   "torch's allow_tf32=False, as bench_models.py runs)")
    p.add_argument("--fma-kernels", action="store_true", help="the whole-sequence kernels' bf16 products on the FMA "
                   "units, as without a ptxas >= 13.3 on Hopper or with WHOLE_SEQUENCE_TENSOR_CORES=fma (default: the "
                   "tensor cores; kernels/ptxas.py; under the measured cap the same cost: that rate is below both "
                   "units' shares, and the FMA form's own is unmeasured)")
    p.add_argument("--kernel-roofline", action="store_true", help="the whole-sequence kernels at their share of the "
                   "peak alone (default: at most the rate per program a lease measured, KERNEL_PROGRAM_FLOPS)")
    p.add_argument("--launch-floor-us", type=float, help="cost added per launch (default: the mode's LAUNCH_S)")
    p.add_argument("--sync-us", type=float, default=HOST_SYNC_S * 1e6, help="cost of one host sync")
    p.add_argument("--crude-launches", action="store_true", help="compiled modes: do not count the compiled "
                   "regions' launches as Inductor emits them (minutes); keep the crude fusion model's")
    p.add_argument("--baseline", default="", help="config costed beside it (default transformer_<flavor>; none: off)")
    p.add_argument("--top", type=int, default=12, help="rows of the top-ops and top-functions tables")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    floor = {} if args.launch_floor_us is None else {"launch_s": args.launch_floor_us * 1e-6}
    hardware = Hardware.for_mode(args.mode, tf32=args.tf32, sync_s=args.sync_us * 1e-6,
                                 kernel_tensor_cores=not args.fma_kernels,
                                 kernel_measured=not args.kernel_roofline, **floor)
    options = dict(seq_len=args.seq_len, batch=args.batch, mode=args.mode, hardware=hardware,
                   inductor_launches=not args.crude_launches)
    try:
        prediction = predict(args.config, whole_sequence=args.whole_sequence, **options)
        baseline = args.baseline or baseline_of(prediction)
        beside = predict(baseline, **options) if baseline and baseline != "none" else None
    except ValueError as e:
        print(f"step_cost: {e}", file=sys.stderr)
        return 2
    print(report(prediction, top=args.top, baseline=beside))
    return 0


if __name__ == "__main__":
    sys.exit(main())
