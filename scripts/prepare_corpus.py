"""Tokenize the offline English corpus (King James Bible) with the GPT-2 BPE into a Megatron
indexed dataset, once. `parakit train data=corpus` calls this itself; run it alone to see it.

    python scripts/prepare_corpus.py
"""

from toolkit.data.corpus import prepare_corpus


def main() -> None:
    import numpy as np

    prefix = prepare_corpus(progress=True)
    tokens = np.memmap(f"{prefix}.bin", dtype=np.uint16, mode="r").size
    print(f"{prefix}.bin/.idx: {tokens:,} tokens")


if __name__ == "__main__":
    main()
