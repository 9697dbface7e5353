"""HPSEmbeddingBagCollection and HPSEmbeddingCollection against TorchRec's own collections holding the served rows
as their weights: KJTs with empty and long bags, features sharing a table, SUM and MEAN, weighted bags, through gRPC
and the colocated store, within 1e-5; a trained collection's state_dict loads into the served one; bad configs and
inputs are refused naming what is wrong; the bag collection compiles with fullgraph=True."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
torchrec = pytest.importorskip("torchrec")

from torchrec import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)

from hps_client.errors import InvalidArgumentError, NotFoundError  # noqa: E402
from hps_client.torchrec import HPSEmbeddingBagCollection, HPSEmbeddingCollection  # noqa: E402
from tests.torch.conftest import TABLES, Served  # noqa: E402

CLIENTS = ["grpc", "local"]


def _bag_configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=TABLES["a"][1], feature_names=["f1", "f2"],
                           pooling=PoolingType.SUM),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=TABLES["b"][1], feature_names=["f3"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=TABLES["c"][1], feature_names=["f4"]),
    ]


def _kjt(keys: list[str], seed: int, batch: int = 6, weighted: bool = False) -> KeyedJaggedTensor:
    """Bags of every length: empty ones, ones of one id, and a long one (300 ids) per key."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (len(keys) * batch,), generator=gen)
    lengths[::5] = 0
    lengths[3] = 300
    values = torch.randint(0, 600, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.shape[0], generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)


def _reference(cls: type, configs: list, served: Served, **kw: object) -> torch.nn.Module:
    """TorchRec's own collection with the served rows as its weights."""
    ref = cls(tables=configs, device=torch.device("cpu"), **kw)
    with torch.no_grad():
        for name, module in (ref.embedding_bags if hasattr(ref, "embedding_bags") else ref.embeddings).items():
            module.weight.copy_(served.weights[name])
    return ref.eval()


@pytest.mark.parametrize("kind", CLIENTS)
def test_the_bag_collection_answers_what_torchrec_s_does(served: Served, kind: str) -> None:
    ours = HPSEmbeddingBagCollection(served.clients[kind], "m", tables=_bag_configs())
    theirs = _reference(EmbeddingBagCollection, _bag_configs(), served)
    for seed, keys in ((1, ["f1", "f2", "f3", "f4"]), (2, ["f4", "extra", "f3", "f2", "f1"])):
        kjt = _kjt(keys, seed)
        got, want = ours(kjt), theirs(kjt)
        assert got.keys() == want.keys() == ["f1", "f2", "f3", "f4"]
        assert got.length_per_key() == want.length_per_key()
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-5, atol=1e-5)
    kjt = _kjt(["f1", "f2", "f3", "f4"], 3)
    handle = ours.prefetch(kjt)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values(), rtol=1e-5, atol=1e-5)
    assert handle.consumed


def test_weighted_bags_and_a_trained_state_dict(served: Served) -> None:
    configs = [EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=1000, feature_names=["f1", "f2"]),
               EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=600, feature_names=["f4"])]
    for c in configs:
        c.pooling = PoolingType.SUM
    ours = HPSEmbeddingBagCollection(served.grpc, "m", tables=configs, is_weighted=True)
    theirs = _reference(EmbeddingBagCollection, configs, served, is_weighted=True)
    kjt = _kjt(["f1", "f2", "f4"], 4, weighted=True)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values(), rtol=1e-5, atol=1e-5)
    container = torch.nn.Sequential(ours)
    assert not container.load_state_dict(torch.nn.Sequential(theirs).state_dict()).unexpected_keys
    assert list(ours.parameters()) == []


@pytest.mark.parametrize("kind", CLIENTS)
def test_the_collection_answers_what_torchrec_s_does(served: Served, kind: str) -> None:
    configs = [EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=1000, feature_names=["f1", "f2"]),
               EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=1000, feature_names=["f3"])]
    ours = HPSEmbeddingCollection(served.clients[kind], "m", tables=configs, need_indices=True)
    theirs = _reference(EmbeddingCollection, configs, served, need_indices=True)
    kjt = _kjt(["f3", "f1", "skipped", "f2"], 5)
    got, want = ours(kjt), theirs(kjt)
    assert sorted(got) == sorted(want) == ["f1", "f2", "f3"]
    for name in want:
        torch.testing.assert_close(got[name].values(), want[name].values(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[name].lengths(), want[name].lengths())
        torch.testing.assert_close(got[name].weights(), want[name].weights())
    handle = ours.prefetch(kjt)
    torch.testing.assert_close(ours(kjt)["f2"].values(), want["f2"].values(), rtol=1e-5, atol=1e-5)
    assert handle.consumed


def test_configs_and_inputs_that_do_not_fit_are_refused(served: Served) -> None:
    wrong_dim = _bag_configs()
    wrong_dim[2].embedding_dim = 16
    with pytest.raises(InvalidArgumentError, match="'c' of model 'm' is served with dim 4, but its config says "
                                                   "embedding_dim=16"):
        HPSEmbeddingBagCollection(served.grpc, "m", tables=wrong_dim)
    lacking = [EmbeddingBagConfig(name="zz", embedding_dim=8, num_embeddings=10, feature_names=["f"])]
    with pytest.raises(NotFoundError, match="model 'm' has no table 'zz'"):
        HPSEmbeddingBagCollection(served.grpc, "m", tables=lacking)
    with pytest.raises(InvalidArgumentError, match="weighted bags are pooled with SUM only"):
        HPSEmbeddingBagCollection(served.grpc, "m", tables=_bag_configs(), is_weighted=True)
    with pytest.raises(InvalidArgumentError, match="one dim"):
        HPSEmbeddingCollection(served.grpc, "m", tables=[EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=9),
                                                          EmbeddingConfig(name="c", embedding_dim=4, num_embeddings=9)])
    ebc = HPSEmbeddingBagCollection(served.local, "m", tables=_bag_configs())
    with pytest.raises(InvalidArgumentError, match="lacks feature\\(s\\) f3"):
        ebc(_kjt(["f1", "f2", "f4"], 6))


def test_the_bag_collection_compiles_whole(served: Served) -> None:
    ebc = HPSEmbeddingBagCollection(served.grpc, "m", tables=_bag_configs())
    kjt = _kjt(["f1", "f2", "f3", "f4"], 7)
    compiled = torch.compile(lambda features: ebc(features).values(), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(kjt), ebc(kjt).values())
