"""Download FineWeb-Edu parquet shards once, to train from a local folder instead of streaming.

    python scripts/download_fineweb_edu.py --out data/fineweb-edu [--subset sample-10BT] [--shards 4]
then train with `--dataloader.dataset fineweb_edu --dataloader.dataset_path data/fineweb-edu`
(and the same path for `--validator.dataloader.dataset_path`: the validation split is a hash
of each document's text, so the two never share a document).

Subsets are the dataset's configs: `sample-10BT` (the paper recipes' default), `sample-100BT`,
`sample-350BT`, or a crawl such as `CC-MAIN-2024-10`. `--shards N` takes the first N
parquet files of the subset (about 2 GB each; all of them without it). Resumable: complete
shards are skipped, and huggingface_hub resumes a partial one. One progress bar over shards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan_ext.data.datasets import FINEWEB_EDU_DEFAULT_SUBSET, FINEWEB_EDU_REPO


def subset_folder(subset: str) -> str:
    """The repo folder of a subset: sample-10BT -> sample/10BT, CC-MAIN-2024-10 -> data/CC-MAIN-2024-10."""
    if subset.startswith("sample-"):
        return "sample/" + subset.removeprefix("sample-")
    return "data/" + subset


def shard_files(files: list[str], subset: str, shards: int | None) -> list[str]:
    """The subset's parquet files among the repo's `files`, in order, the first `shards`."""
    prefix = subset_folder(subset) + "/"
    chosen = sorted(f for f in files if f.startswith(prefix) and f.endswith(".parquet"))
    return chosen[:shards] if shards else chosen


def download(out: Path, subset: str, shards: int | None, api=None, fetch=None) -> list[Path]:
    """Download the subset's first `shards` parquet files under `out`; returns their paths.
    `api` / `fetch` default to huggingface_hub's HfApi() / hf_hub_download (tests pass fakes)."""
    from tqdm import tqdm

    if api is None or fetch is None:
        from huggingface_hub import HfApi, hf_hub_download

        api, fetch = api or HfApi(), fetch or hf_hub_download
    files = shard_files(api.list_repo_files(FINEWEB_EDU_REPO, repo_type="dataset"), subset, shards)
    if not files:
        raise SystemExit(f"error: no parquet shards for subset '{subset}' in {FINEWEB_EDU_REPO}: pass --subset "
                         "sample-10BT, sample-100BT, sample-350BT or a CC-MAIN-<year>-<week> crawl")
    paths = []
    for name in tqdm(files, desc=f"{subset} shards", unit="shard"):
        target = out / name
        if not target.is_file():  # complete shards are skipped; hf_hub_download resumes partial ones
            fetch(FINEWEB_EDU_REPO, name, repo_type="dataset", local_dir=str(out))
        paths.append(target)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--subset", default=FINEWEB_EDU_DEFAULT_SUBSET)
    parser.add_argument("--shards", type=int, help="first N parquet files (default: all)")
    args = parser.parse_args(argv)
    paths = download(args.out, args.subset, args.shards)
    size = sum(p.stat().st_size for p in paths) / 1e9
    print(f"{len(paths)} shards, {size:.1f} GB in {args.out}: pass --dataloader.dataset_path {args.out}", file=sys.stdout)


if __name__ == "__main__":
    main()
