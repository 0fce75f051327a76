"""The embedded launcher serves /v1/embeddings when asked, as llama-server does."""

from __future__ import annotations

import pytest

from daemon.slots.launcher import build_params, parse_args

xllamacpp = pytest.importorskip("xllamacpp")


def test_embeddings_and_pooling_flags() -> None:
    plain = build_params(parse_args(["--model", "m.gguf"]))
    assert not plain.embedding
    args = parse_args(["--model", "m.gguf", "--embeddings", "--pooling", "mean"])
    params = build_params(args)
    assert params.embedding
    assert params.pooling_type == xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN
    with pytest.raises(SystemExit):
        parse_args(["--model", "m.gguf", "--pooling", "max"])
