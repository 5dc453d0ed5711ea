"""llama.cpp's own ``convert_hf_to_gguf.py`` on a checkpoint written by ``llama_cpp_checkpoint.py``, for any shape.

The converter reads a Qwen-family vocabulary as BPE and checks its pre-tokenizer against the ones it knows, by the
hash of a test string's tokens; the generated checkpoints carry a SentencePiece tokenizer, which that check cannot
know. Their vocabulary is meaningless anyway (random weights), so this runs the converter with its BPE vocabulary
step replaced by its SentencePiece one; the weights and the architecture's metadata go through the converter's own
code for that architecture, unchanged.

    python benchmarks/llama_cpp_convert.py LLAMA_CPP_SOURCE CHECKPOINT --outtype bf16 --outfile OUT.gguf
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    source = Path(sys.argv[1])
    script = source / "convert_hf_to_gguf.py"
    if not script.is_file():
        sys.exit(f"no convert_hf_to_gguf.py in {source}: give llama.cpp's source folder")
    sys.path[:0] = [str(source / "gguf-py"), str(source)]
    from conversion.base import TextModel  # llama.cpp's converter package, from that source

    TextModel._set_vocab_gpt2 = TextModel._set_vocab_sentencepiece
    sys.argv = [str(script), *sys.argv[2:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
