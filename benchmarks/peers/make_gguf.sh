#!/usr/bin/env bash
# Convert kiln's default model (HF directory) to GGUF bf16 and q8_0 with the llama.cpp converter
# vendored in the llama-cpp-python sdist, into /work/main/peers/gguf/ (git-ignored).
#   usage: benchmarks/peers/make_gguf.sh [OUTTYPE...]      (default: bf16 q8_0; ~1 min each)
#   env:   MODEL_DIR (default ~/.cache/kiln/models/SmolLM2-135M-Instruct), PEERS_DIR,
#          FORCE=1 to redo existing files,
#          PRE_TOKENIZER=NAME to force the converter's BPE pre-tokenizer (only needed for a
#          tokenizer whose hash llama.cpp does not know, e.g. a locally trained one: "gpt-2").
# The real SmolLM2 tokenizer is recognised by its hash as "smollm"; the script checks that the
# GGUF says so and that llama.cpp tokenizes a sample exactly as the HF tokenizer does.
# Needs benchmarks/peers/setup_llamacpp.sh first.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$REPO/peers}"
PY="$PEERS_DIR/llamacpp-venv/bin/python"
LLAMA_DIR="$PEERS_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp"
MODEL_DIR="${MODEL_DIR:-$HOME/.cache/kiln/models/SmolLM2-135M-Instruct}"
NAME="$(basename "${MODEL_DIR%/}")"
OUT="$PEERS_DIR/gguf"
TYPES=("$@"); [[ ${#TYPES[@]} -gt 0 ]] || TYPES=(bf16 q8_0)

test -f "$LLAMA_DIR/convert_hf_to_gguf.py" && test -x "$PY" \
  || { echo "run benchmarks/peers/setup_llamacpp.sh first" >&2; exit 1; }
test -f "$MODEL_DIR/config.json" || { echo "no model at $MODEL_DIR" >&2; exit 1; }
mkdir -p "$OUT"

for t in "${TYPES[@]}"; do
  f="$OUT/$NAME-$t.gguf"
  if [[ -s "$f" && "${FORCE:-0}" != 1 ]]; then echo "exists: $f"; continue; fi
  tmp="$f.partial"
  rm -f "$tmp"
  "$PY" - "$LLAMA_DIR" "$MODEL_DIR" --outtype "$t" --outfile "$tmp" <<'PY'
import os, sys
llama_dir = sys.argv.pop(1)
sys.path[:0] = [llama_dir, os.path.join(llama_dir, "gguf-py")]   # the vendored gguf-py
pre = os.environ.get("PRE_TOKENIZER")
if pre:  # same trick as shared/peers/convert_gguf.py, for tokenizers llama.cpp cannot identify
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf
sys.argv[0] = "convert_hf_to_gguf.py"
convert_hf_to_gguf.main()
PY
  mv "$tmp" "$f"
  echo "wrote $f"
done

# Check: metadata, and llama.cpp's tokenization against the HF tokenizer's.
for t in "${TYPES[@]}"; do
  "$PY" - "$OUT/$NAME-$t.gguf" "$MODEL_DIR" "$LLAMA_DIR" <<'PY'
import os, sys
gguf_path, model_dir, llama_dir = sys.argv[1:4]
sys.path.insert(0, os.path.join(llama_dir, "gguf-py"))
import gguf
from llama_cpp import Llama
from transformers import AutoTokenizer

r = gguf.GGUFReader(gguf_path)
def field(k):
    f = r.fields[k]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]
pre, ftype = field("tokenizer.ggml.pre"), field("general.file_type")
text = ("The capital of France is Paris.\n\n  def f(x):\treturn x**2  # 3.14159, 12345!\n"
        "<|im_start|>user\nWhat's new? I'll see, we've 'RE done.<|im_end|>\n")
hf = AutoTokenizer.from_pretrained(model_dir)
ref = hf(text, add_special_tokens=False)["input_ids"]
llm = Llama(model_path=gguf_path, vocab_only=True, verbose=False)
got = llm.tokenize(text.encode(), add_bos=False, special=True)
print(f"{os.path.basename(gguf_path)}: {os.path.getsize(gguf_path) / 1e6:.1f} MB, pre={pre}, "
      f"file_type={gguf.LlamaFileType(ftype).name}, tensors={len(r.tensors)}, "
      f"tokenization {'matches HF' if got == ref else 'DIFFERS from HF'} ({len(ref)} ids)")
sys.exit(0 if got == ref else 1)
PY
done
