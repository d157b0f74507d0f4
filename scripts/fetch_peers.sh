#!/usr/bin/env bash
# The peers' sources that bench/peer_*.py import, exported here from local mirrors of their
# repositories (never committed: /peers/ is ignored; the device call carries the folder). Nothing
# is downloaded: the GPU machine has no network, and a mirror is read with git.
#   gpt-fast (pytorch-labs/gpt-fast): model.py and LICENSE at the mirror's HEAD, and COMMIT (the
#   full hash) that bench/peer_gpt_fast.py reports.
# Usage: scripts/fetch_peers.sh [--gpt-fast-repo GIT_DIR] [--gpt-fast DIR]
#   --gpt-fast-repo  the mirror (default $GPT_FAST_REPO or /work/.mirror/pytorch-labs+gpt-fast/repo)
#   --gpt-fast       where to export (default peers/gpt-fast)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=${GPT_FAST_REPO:-/work/.mirror/pytorch-labs+gpt-fast/repo}
dest=peers/gpt-fast
while [ $# -gt 0 ]; do
  case "$1" in
    --gpt-fast-repo) [ $# -ge 2 ] || { echo "fetch_peers.sh: --gpt-fast-repo needs a directory" >&2; exit 2; }
      repo=$2; shift 2 ;;
    --gpt-fast) [ $# -ge 2 ] || { echo "fetch_peers.sh: --gpt-fast needs a directory" >&2; exit 2; }
      dest=$2; shift 2 ;;
    *) echo "fetch_peers.sh: unknown argument $1; usage: scripts/fetch_peers.sh" \
      "[--gpt-fast-repo GIT_DIR] [--gpt-fast DIR]" >&2; exit 2 ;;
  esac
done
commit=$(git -C "$repo" rev-parse --verify 'HEAD^{commit}' 2>/dev/null) || {
  echo "fetch_peers.sh: $repo: not a git repository with a HEAD commit; give the gpt-fast mirror" \
    "with --gpt-fast-repo" >&2
  exit 1
}
if [ -e "$dest" ] && [ ! -f "$dest/COMMIT" ] && [ -n "$(ls -A "$dest" 2>/dev/null)" ]; then
  echo "fetch_peers.sh: $dest exists and is not an earlier export (no COMMIT file); give another" \
    "--gpt-fast directory" >&2
  exit 1
fi
# Written beside the destination and moved into place whole, so that an interrupted export leaves
# no half-filled folder behind.
mkdir -p "$(dirname "$dest")"
tmp=$(mktemp -d "$(dirname "$dest")/.gpt-fast.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
for f in model.py LICENSE; do
  git -C "$repo" show "$commit:$f" >"$tmp/$f" || {
    echo "fetch_peers.sh: $repo at $commit has no $f" >&2
    exit 1
  }
done
echo "$commit" >"$tmp/COMMIT"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "gpt-fast $commit -> $dest ($(wc -l <"$dest/model.py") lines of model.py)"
