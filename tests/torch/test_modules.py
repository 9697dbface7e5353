"""HPSEmbedding and HPSEmbeddingBag against torch's own F.embedding and F.embedding_bag over the same weights, through
gRPC and the colocated store: shapes, sum, mean, weights, empty bags, 2-D input, include_last_offset; prefetch; and
the errors a user gets for bad input."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from hps_client.errors import InvalidArgumentError, NotFoundError  # noqa: E402
from hps_client.torch import HPSEmbedding, HPSEmbeddingBag  # noqa: E402
from tests.torch.conftest import Served  # noqa: E402

CLIENTS = ["grpc", "local"]


@pytest.mark.parametrize("kind", CLIENTS)
def test_embedding_answers_what_f_embedding_does_for_ids_of_any_shape(served: Served, kind: str) -> None:
    emb = HPSEmbedding(served.clients[kind], "m", "a")
    assert emb.embedding_dim == 8 and list(emb.parameters()) == []
    gen = torch.Generator().manual_seed(1)
    for shape in [(5,), (3, 4), (2, 3, 2), (0,), (4, 0)]:
        ids = torch.randint(0, 1000, shape, generator=gen)
        got = emb(ids)
        want = F.embedding(ids, served.weights["a"])
        assert got.shape == want.shape and got.dtype == torch.float32 and got.device == ids.device
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    ids32 = torch.tensor([[7, 7], [999, 0]], dtype=torch.int32)
    torch.testing.assert_close(emb(ids32), F.embedding(ids32, served.weights["a"]), rtol=0, atol=1e-5)


def _bag_cases(gen: torch.Generator) -> list[tuple[str, dict]]:
    """(name, kwargs of F.embedding_bag less the weight) covering every form EmbeddingBag takes."""
    lengths = torch.tensor([3, 0, 1, 7, 0, 2, 40])
    ids = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    weights = torch.randn(ids.shape[0], generator=gen)
    fixed = torch.randint(0, 1000, (6, 5), generator=gen)
    return [
        ("sum", dict(input=ids, offsets=offsets, mode="sum")),
        ("mean", dict(input=ids, offsets=offsets, mode="mean")),
        ("weights", dict(input=ids, offsets=offsets, mode="sum", per_sample_weights=weights)),
        ("empty bags only", dict(input=ids[:0], offsets=torch.zeros(4, dtype=torch.long), mode="mean")),
        ("no bag", dict(input=ids[:0], offsets=offsets[:0], mode="sum")),
        ("2-D mean", dict(input=fixed, mode="mean")),
        ("2-D weights", dict(input=fixed, mode="sum", per_sample_weights=torch.randn(6, 5, generator=gen))),
        ("include_last_offset", dict(input=ids, offsets=torch.cat([offsets, torch.tensor([ids.shape[0]])]),
                                     mode="mean", include_last_offset=True)),
        # ids past the last offset are in no bag (torch's CPU mean counts them in the last bag's length: sum here)
        ("ids past the last offset", dict(input=ids, offsets=torch.cat([offsets, torch.tensor([ids.shape[0] - 3])]),
                                          mode="sum", include_last_offset=True)),
        ("int32 ids", dict(input=ids.int(), offsets=offsets.int(), mode="sum")),
    ]


@pytest.mark.parametrize("kind", CLIENTS)
def test_embedding_bag_answers_what_f_embedding_bag_does(served: Served, kind: str) -> None:
    for name, case in _bag_cases(torch.Generator().manual_seed(2)):
        case = dict(case)
        mode, last = case.pop("mode"), case.pop("include_last_offset", False)
        bag = HPSEmbeddingBag(served.clients[kind], "m", "b", mode=mode, include_last_offset=last)
        got = bag(**case)
        want = F.embedding_bag(weight=served.weights["b"], mode=mode, include_last_offset=last, **case)
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_rows_land_on_the_device_asked_and_the_module_takes_no_gradient(served: Served) -> None:
    bag = HPSEmbeddingBag(served.grpc, "m", "c", mode="sum", device="cpu")
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    weights = torch.ones(3, requires_grad=True)
    got = bag(ids, offsets, weights.detach())
    assert got.device == torch.device("cpu") and not got.requires_grad
    bag.train()  # dense layers above fixed served rows may train; a gradient through the rows may not
    with pytest.raises(InvalidArgumentError, match="inference-only"):
        bag(ids, offsets, weights)
    with torch.no_grad():
        torch.testing.assert_close(bag(ids, offsets, weights), got)


@pytest.mark.parametrize("kind", CLIENTS)
def test_prefetch_hands_its_rows_to_the_next_forward_with_those_ids(served: Served, kind: str) -> None:
    emb = HPSEmbedding(served.clients[kind], "m", "a")
    bag = HPSEmbeddingBag(served.clients[kind], "m", "b", mode="sum")
    ids = torch.randint(0, 999, (64, 3), generator=torch.Generator().manual_seed(3))  # ids + 1: rows too
    offsets = torch.arange(0, 192, 3)
    handle = emb.prefetch(ids)
    bag_handle = bag.prefetch(ids.reshape(-1), offsets)
    other = emb.prefetch(ids + 1)
    torch.testing.assert_close(handle.wait(), F.embedding(ids, served.weights["a"]))
    got = emb(ids)
    assert handle.consumed and not other.consumed
    torch.testing.assert_close(got, F.embedding(ids, served.weights["a"]))
    torch.testing.assert_close(bag(ids.reshape(-1), offsets), F.embedding_bag(ids.reshape(-1), served.weights["b"],
                                                                              offsets, mode="sum"))
    assert bag_handle.consumed
    torch.testing.assert_close(emb(ids + 1), F.embedding(ids + 1, served.weights["a"]))
    assert other.consumed
    again = emb(ids)  # nothing pending: looked up now
    torch.testing.assert_close(again, got)


def test_bad_input_gets_an_error_that_names_it(served: Served) -> None:
    emb = HPSEmbedding(served.grpc, "m", "a")
    bag = HPSEmbeddingBag(served.grpc, "m", "a", mode="mean")
    ids = torch.tensor([1, 2, 3, 4])
    with pytest.raises(InvalidArgumentError, match="integer ids"):
        emb(torch.tensor([1.0, 2.0]))
    with pytest.raises(InvalidArgumentError, match="integer ids"):
        bag(torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(InvalidArgumentError, match=r"offsets\[0\] must be 0"):
        bag(ids, torch.tensor([1, 2]))
    with pytest.raises(InvalidArgumentError, match="must not decrease"):
        bag(ids, torch.tensor([0, 3, 2]))
    with pytest.raises(InvalidArgumentError, match="past the end of input"):
        bag(ids, torch.tensor([0, 7]))
    with pytest.raises(InvalidArgumentError, match="offsets must be None"):
        bag(ids.reshape(2, 2), torch.tensor([0, 1]))
    with pytest.raises(InvalidArgumentError, match="needs offsets"):
        bag(ids)
    with pytest.raises(InvalidArgumentError, match="only served with mode 'sum'"):
        bag(ids, torch.tensor([0, 2]), torch.ones(4))
    with pytest.raises(InvalidArgumentError, match="one weight per id"):
        HPSEmbeddingBag(served.grpc, "m", "a", mode="sum")(ids, torch.tensor([0, 2]), torch.ones(3))
    with pytest.raises(InvalidArgumentError, match="the last offset is 9"):
        HPSEmbeddingBag(served.grpc, "m", "a", mode="sum", include_last_offset=True)(ids, torch.tensor([0, 9]))
    with pytest.raises(InvalidArgumentError, match="'max' is not served"):
        HPSEmbeddingBag(served.grpc, "m", "a", mode="max")
    with pytest.raises(NotFoundError, match="model 'm' has no table 'zz' \\(its tables: a, b, c\\)"):
        HPSEmbedding(served.grpc, "m", "zz")
    with pytest.raises(NotFoundError, match="model 'nope' is not served"):
        HPSEmbeddingBag(served.local, "nope", "a")
