"""Write a random-weight checkpoint of a bench shape, with a small SentencePiece tokenizer, for llama.cpp's converter.

llama.cpp's ``convert_hf_to_gguf.py`` needs a tokenizer beside the weights; the bench's shapes have none (no hub
here). This trains a SentencePiece model on generated words (the converter pads its vocabulary to the config's
``vocab_size`` with unused tokens), so the GGUF has the model's real shapes and a working, meaningless vocabulary.
Llama-family shapes (Mixtral) go through the converter's SentencePiece path as they are; Qwen3-MoE's converter reads
its vocabulary as BPE and checks it against known pre-tokenizers, so convert through ``llama_cpp_convert.py``, which
has it read the generated tokenizer as SentencePiece.

    python benchmarks/llama_cpp_checkpoint.py mixtral-8x7b|qwen3-30b-a3b OUT_DIR --layers 4 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from duoserve.bench.shapes import save_shape
from duoserve.loading import model_from_config

SPM_VOCAB = 512  # enough pieces for generated text; the converter pads to the model's vocab_size


def write_tokenizer(folder: Path, seed: int = 0) -> None:
    """A SentencePiece ``tokenizer.model`` trained on random lowercase words, plus the config files naming it."""
    import sentencepiece as spm

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(" ".join("".join(rng.choices(letters, k=rng.randint(2, 8)))
                                             for _ in range(12)) for _ in range(4000)))
        spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"),
                                       vocab_size=SPM_VOCAB, model_type="bpe", bos_id=1, eos_id=2, unk_id=0,
                                       minloglevel=2)
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
         "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", help="a bench shape name (duoserve.bench.shapes)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda is faster)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    save_shape(args.shape, args.out, args.layers)
    torch.manual_seed(0)
    model = model_from_config(str(args.out), torch.device(args.device), args.dtype)
    model.save_pretrained(args.out, max_shard_size="5GB")
    write_tokenizer(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
