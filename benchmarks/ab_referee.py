"""The referee (../shared/bench/side_by_side.py) on two versions of the package, alternating runs.

For a change that may move step time: each run of the referee measures one version (the
working tree, or a git commit checked out into a temporary worktree, put first on PYTHONPATH);
runs alternate between the two, so the machine's load drifts over both alike. Reports, per b,
the medians over runs of the referee's own medians and ratios, and each pair's new / old.

  python benchmarks/ab_referee.py --old e0370a6 --bs 8,32,256 --reps 4 --out benchmarks/results
  python benchmarks/ab_referee.py --old e0370a6 --opt muon --bs 32 --reps 2
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFEREE = ROOT.parent / "shared" / "bench" / "side_by_side.py"
RATIOS = {
  "ga / min_scan": ("ga", "min_scan"),
  "ga / plain": ("ga", "plain"),
  "ga / microbat": ("ga", "microbat"),
  "ga_stream / ms_loop": ("ga_stream", "ms_loop"),
}


def referee(src: Path, b: int, referee: Path, opt: str = "adam") -> dict:
  env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}
  out = subprocess.run(
    [sys.executable, str(referee), "--b", str(b), "--opt", opt], capture_output=True, text=True, env=env,
    cwd=tempfile.gettempdir(), check=True, timeout=900,
  )  # fmt: skip
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--old", required=True, help="the git commit to compare the working tree with")
  ap.add_argument("--bs", default="8,32,256")
  ap.add_argument("--reps", type=int, default=4)
  ap.add_argument("--opt", default="adam", help="the referee's optimizer: adam or muon")
  ap.add_argument("--referee", default=str(REFEREE))
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    old = Path(tmp) / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "-q", str(old), args.old],
                   check=True)  # fmt: skip
    try:
      runs = collections.defaultdict(lambda: collections.defaultdict(list))
      for b in map(int, args.bs.split(",")):
        for _ in range(args.reps):
          for name, src in (("old", old), ("new", ROOT)):
            runs[b][name].append(referee(src, b, Path(args.referee), args.opt)["ms"])
    finally:
      subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)])
  lines = [
    f"# The referee on two versions: {args.old} (old) against the working tree (new)\n",
    f"`side_by_side.py --b B --opt {args.opt}`, k = 8, {args.reps} runs of each version per b, alternating;"
    " each run's figure is the referee's median of its rounds; below, the median over runs.\n",
    "| b | version | ga ms | " + " | ".join(RATIOS) + " | new / old ga ms, per pair |",
    "|---" * (4 + len(RATIOS)) + "|",
  ]
  for b, by in runs.items():
    pairs = ", ".join(f"{n['ga'] / o['ga']:.3f}" for o, n in zip(by["old"], by["new"], strict=True))
    for name in ("old", "new"):
      ms = by[name]
      med = lambda f, ms=ms: statistics.median(f(m) for m in ms)  # noqa: E731
      cells = " | ".join(f"{med(lambda m, a=a, c=c: m[a] / m[c]):.3f}" for a, c in RATIOS.values())
      lines.append(
        f"| {b} | {name} | {med(lambda m: m['ga']):.2f} | {cells} |"
        f" {pairs if name == 'new' else ''} |"
      )
  md = "\n".join(lines) + "\n"
  print(md)
  if args.out:
    stem = "ab_referee" if args.opt == "adam" else f"ab_referee_{args.opt}"
    Path(args.out, f"{stem}.md").write_text(md)
    Path(args.out, f"{stem}.json").write_text(json.dumps({"old": args.old, "runs": runs}))


if __name__ == "__main__":
  main()
