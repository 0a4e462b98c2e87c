"""Decode benchmark (issue 4): sparrow vs transformers on a random-weight model of a named shape.

    python benchmarks/decode.py --model-shape llama3-8b [--batch-sizes 1,8,64] [--prompt-len 128,2048]
                                [--decode-tokens 64] [--profile] [--out results.json]

The same as ``sparrow bench``, every flag included (see benchmarks/README.md); with no --model-shape it
benchmarks --model, or the packaged default model.
"""
import sys

from sparrow.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
