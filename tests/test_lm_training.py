"""A small GPT-style language model trained on token windows read through dmdask.

The text is real and ships with Python: the source of the standard library's `json`,
`email`, `http` and `unittest` packages; the tokenizer is byte-level (token = UTF-8
byte, a vocabulary of 256, as ByT5), so nothing is downloaded or trained at run time.
The tokens are a 1-D Zarr array on a two-worker dmdask cluster; each sample is a window
of `SEQ + 1` tokens at a stride of `SEQ` (inputs and next-token targets), shuffled."""
from __future__ import annotations

import os
import sysconfig

import distributed
import numpy as np
import pytest
import zarr

torch = pytest.importorskip("torch")

import dmdask  # noqa: E402

SEQ, BATCH, STEPS = 64, 16, 160
PACKAGES = ("json", "email", "http", "unittest")


def stdlib_text() -> bytes:
    """The standard library source of PACKAGES, files in sorted order."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for package in PACKAGES:
        for folder, _, names in sorted(os.walk(os.path.join(root, package))):
            out += [open(os.path.join(folder, n), "rb").read() for n in sorted(names) if n.endswith(".py")]
    return b"\n".join(out)


class TinyGPT(torch.nn.Module):
    """Token and position embeddings, two causal self-attention blocks, a linear head."""

    def __init__(self, vocab: int = 256, width: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(SEQ, width)
        block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        return self.head(self.blocks(x, mask=self.causal, is_causal=True))


def test_a_small_gpt_learns_from_token_windows_read_through_dmdask(tmp_path):
    text = stdlib_text()
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)  # byte-level tokenizer
    assert len(tokens) > 500_000
    path = str(tmp_path / "stdlib.zarr")
    zarr.open_group(path, mode="w", zarr_format=3).create_array("tokens", shape=tokens.shape, chunks=(65536,),
                                                                dtype="uint16")[:] = tokens
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, epoch = [], 0
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(path, batch_size=BATCH, seed=0, window=dmdask.Window(SEQ + 1, stride=SEQ))
        while len(losses) < STEPS:
            for batch in dmdask.batches(client, spec, epoch=epoch):
                for w, row in zip(batch["index"][:2].tolist(), batch["tokens"][:2]):  # the corpus's own tokens
                    np.testing.assert_array_equal(row, tokens[w * SEQ:w * SEQ + SEQ + 1])
                ids = torch.from_numpy(batch["tokens"].astype(np.int64))
                logits = model(ids[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                if len(losses) == STEPS:
                    break
            epoch += 1
    first, last = losses[0], np.mean(losses[-20:])
    assert first > 4.5  # about ln(256) = 5.5 untrained
    assert last < first - 2.0 and last < 3.0, f"loss {first:.2f} -> {last:.2f}"  # it learnt the text's bytes
