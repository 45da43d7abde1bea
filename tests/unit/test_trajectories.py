"""``data=gym`` (``xfam.data.trajectories``) and its environments (``xfam.data.gym_envs``): experts beat random
behaviour, returns-to-go, left-padded windows, determinism, a local D4RL-style folder, filtered BC, and batches
the Decision Transformer's embedding reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xfam.core.errors import ConfigError
from xfam.core.trajectory import StepLayout
from xfam.data import DATA
from xfam.data.episodes import Chunks, Episodes, Windows, collate_decision
from xfam.data.gym_envs import ENVS, from_env_action, make_env, policy, run_episode, to_env_action
from xfam.data.module import XfamDataModule
from xfam.data.trajectories import _episode_rows, _generator_params
from xfam.model.inputs import DecisionEmbedding


def build(**params) -> object:
    return DATA.build({"name": "gym", **params})


@pytest.fixture(scope="module")
def sources() -> dict[str, object]:
    out = {}
    for env in ("cartpole", "pendulum"):
        out[env] = build(env=env, episodes=3, context=8, batch_size=16)
        out[env].prepare()
    return out


def mean_return(name: str, kind: str, episodes: int = 2) -> float:
    env, rng = make_env(name), np.random.default_rng(0)
    act = policy(name, kind, 0.3, rng)
    return float(np.mean([run_episode(env, act, seed=s)["rewards"].sum() for s in range(episodes)]))


@pytest.mark.parametrize("name", list(ENVS))
def test_the_expert_beats_random_behaviour(name: str) -> None:
    assert mean_return(name, "expert") > mean_return(name, "random") + 50


def test_an_episode_has_the_stored_layout_and_normalised_actions() -> None:
    info = ENVS["pendulum"]
    ep = run_episode(make_env("pendulum"), policy("pendulum", "random", 0.0, np.random.default_rng(1)), seed=3)
    assert ep["observations"].shape == (200, 3) and ep["actions"].shape == (200, 1)
    assert ep["actions"].dtype == np.float32 and np.abs(ep["actions"]).max() <= 1
    assert ep["timeouts"][-1] and not ep["terminals"].any() and ep["timeouts"].sum() == 1
    env_action = np.array([1.5], dtype=np.float32)
    assert np.allclose(from_env_action(info, env_action), [0.75])
    assert np.allclose(to_env_action(info, from_env_action(info, env_action)), env_action)
    assert to_env_action(info, np.array([3.0]))[0] == 2.0  # clipped to the bounds
    cart = run_episode(make_env("cartpole"), policy("cartpole", "random", 0.0, np.random.default_rng(1)), seed=3)
    assert cart["actions"].dtype == np.int64 and cart["terminals"][-1] and not cart["timeouts"].any()


def tiny() -> Episodes:
    """Two handmade episodes: rewards 1, 2, 3 and 4, 5; states [t, 10 e]; actions 0, 1, 0 and 1, 1."""
    states = np.array([[0, 0], [1, 0], [2, 0], [0, 10], [1, 10]], dtype=np.float32)
    actions = np.array([0, 1, 0, 1, 1], dtype=np.int64)
    rewards = np.array([1, 2, 3, 4, 5], dtype=np.float32)
    return Episodes(states, actions, rewards, np.array([3, 2]))


def test_returns_to_go_are_the_rest_of_the_episode_scaled() -> None:
    rows = Windows(tiny(), context=3, return_scale=2.0)
    expected = np.array([1 + 2 + 3, 2 + 3, 3, 4 + 5, 5]) / 2.0
    assert np.allclose(rows.rtg, expected)
    assert np.allclose(tiny().returns, [6, 9])
    assert torch.allclose(rows[2]["returns"], torch.tensor([6, 5, 3]) / 2.0)


def test_windows_are_left_padded_and_every_step_ends_one() -> None:
    ep, rows = tiny(), Windows(tiny(), context=3, return_scale=1.0)
    assert len(rows) == 5
    first = rows[0]
    assert first["step_mask"].tolist() == [False, False, True]
    assert first["timesteps"].tolist() == [0, 0, 0] and first["states"][:2].abs().sum() == 0
    second_episode = rows[4]  # step 1 of episode 2: one padded slot, nothing of episode 1
    assert second_episode["step_mask"].tolist() == [False, True, True]
    assert second_episode["timesteps"].tolist() == [0, 0, 1]
    assert second_episode["states"].tolist() == [[0, 0], [0, 10], [1, 10]]
    assert second_episode["actions"].tolist() == [0, 1, 1] and second_episode["returns"].tolist() == [0, 9, 5]
    gathered = rows.__getitems__([0, 4, 2])  # a DataLoader's batched fetch
    assert all(torch.equal(g[k], rows[i][k]) for g, i in zip(gathered, [0, 4, 2]) for k in g)
    for i in range(len(rows)):
        row = rows[i]
        assert row["step_mask"][-1] and torch.equal(row["states"][-1], torch.from_numpy(ep.states[i]))
        assert row["timesteps"][-1] == ep.timesteps[i]


def test_stream_chunks_lay_the_episodes_end_to_end_and_mark_them() -> None:
    """data.stream: row k + 1 continues row k; episodes are documents (ids per token, the row ending one)."""
    ep = Episodes.concat([tiny(), tiny()])  # 4 episodes of lengths 3, 2, 3, 2: 10 steps
    rows = Chunks(ep, context=3, return_scale=1.0, seed=0)
    assert len(rows) == 3  # the 10th step, a partial chunk, is dropped
    laid = rows.episodes  # the episodes in the chunks' seeded order
    flat = [rows[i] for i in range(3)]
    assert torch.equal(torch.cat([r["states"] for r in flat]), torch.from_numpy(laid.states[:9]))
    assert all(r["step_mask"].all() for r in flat)
    for r in flat:  # the row's first episode is 0, + 1 at every episode start after it
        starts = r["timesteps"] == 0
        assert r["episode"][0] == 0 and torch.equal(r["episode"], torch.cumsum(starts.long(), 0) - starts[0].long())
    ends = np.cumsum(laid.lengths)  # a row whose last step ends an episode
    assert [bool(r["doc_end"]) for r in flat] == [3 * (i + 1) in ends for i in range(3)]
    batch = collate_decision(flat, StepLayout(max_timestep=5, state_dim=2, num_actions=2))
    assert torch.equal(batch["segments"][:, ::3], batch["segments"][:, 1::3]) and batch["segments"].shape == (3, 9)
    assert "key_padding" not in batch and batch["doc_end"].dtype == torch.bool


def test_the_generated_windows_cover_every_step_with_absolute_timesteps(sources) -> None:
    src = sources["cartpole"]
    for name in ("train", "validation", "test"):
        ep, rows = src.episodes(name), src.split(name)
        assert len(rows) == int(ep.lengths.sum()) == src.manifest["splits"][name]["windows"]
        assert sorted(ep.policies) == ["expert", "noisy", "random"]  # every split mixes the policies
    ep, rows = src.episodes("train"), src.split("train")
    long = int(np.argmax(ep.lengths))
    last = int(ep.starts[long] + ep.lengths[long] - 1)
    row = rows[last]
    assert row["step_mask"].all() and row["timesteps"].tolist() == list(range(ep.lengths[long] - 8, ep.lengths[long]))


def test_the_same_settings_make_the_same_data_and_another_seed_other_data() -> None:
    params = {"env": "cartpole", "episodes": 3, "policies": ["noisy", "random"], "noise": 0.3, "seed": 5}
    a, b = (list(_episode_rows(_generator_params(params), "train")) for _ in range(2))
    assert all(np.array_equal(x["observations"], y["observations"]) for x, y in zip(a, b))
    assert [x["actions"].tolist() for x in a] == [y["actions"].tolist() for y in b]
    other = list(_episode_rows(_generator_params({**params, "seed": 6}), "train"))
    assert [x["observations"].tolist() for x in a] != [x["observations"].tolist() for x in other]
    one, two = build(env="cartpole", episodes=3, seed=5), build(env="cartpole", episodes=3, seed=5)
    one.prepare(), two.prepare()
    assert one.fingerprint == two.fingerprint and one.manifest == two.manifest
    assert np.array_equal(one.episodes("test").states, two.episodes("test").states)
    third = build(env="cartpole", episodes=3, seed=6)
    third.prepare()
    assert third.fingerprint != one.fingerprint
    assert not np.array_equal(one.episodes("train").states[:5], third.episodes("train").states[:5])


def folder_rows(actions: list) -> dict[str, list]:
    """Three episodes of one row per timestep: 3 steps ending in a terminal, 2 in a timeout, 4 cut by the end."""
    lengths, done = [3, 2, 4], []
    terminals = [False, False, True, False, False, False, False, False, False]
    timeouts = [False, False, False, False, True, False, False, False, False]
    for n in lengths:
        done += list(range(n))
    return {
        "observations": [[float(t), float(i)] for i, t in enumerate(done)],
        "actions": actions,
        "rewards": [1.0] * 9,
        "terminals": terminals,
        "timeouts": timeouts,
    }


def test_a_local_folder_splits_into_episodes_at_terminals_and_timeouts(tmp_path) -> None:
    from datasets import Dataset

    Dataset.from_dict(folder_rows([0, 1, 2, 0, 1, 2, 0, 1, 2])).save_to_disk(str(tmp_path / "d"))
    params = {"env": None, "path": str(tmp_path / "d"), "context": 4, "batch_size": 1}
    assert DATA.check({"name": "gym", **params}, {}) == []
    src = build(**params)
    assert src.inputs == {
        "kind": "decision",
        "state_dim": 2,
        "num_actions": 3,
        "max_timestep": 4,
        "returns": True,
        "context": 4,
    }
    src.prepare()
    lengths = sorted(int(n) for s in ("train", "validation", "test") for n in src.episodes(s).lengths)
    assert lengths == [2, 3, 4] and src.decision["reference_returns"] is None and src.decision["env"] is None
    train = src.episodes("train")  # one episode of each split (10 % of 3, at least one)
    assert len(train.lengths) == 1 and src.decision["return_scale"] == float(train.lengths[0])  # rewards 1
    batch = src.collate([src.split("train")[i] for i in range(len(src.split("train")))])
    assert batch["inputs"].shape[1:] == (4, 1 + 2 + 1 + 1)


def test_a_folder_of_env_actions_is_normalised_and_checked_against_the_env(tmp_path) -> None:
    from datasets import Dataset

    rows = folder_rows([[2.0], [-2.0], [1.0], [0.0], [0.0], [0.0], [0.0], [0.0], [0.0]])
    rows["observations"] = [o + [0.0] for o in rows["observations"]]  # pendulum's 3 values
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "p"))
    src = build(env="pendulum", path=str(tmp_path / "p"), context=2)
    src.prepare()
    actions = np.concatenate([src.episodes(s).actions for s in ("train", "validation", "test")])
    assert actions.shape == (9, 1) and actions.min() == -1 and actions.max() == 1 and 0.5 in actions
    assert src.inputs["max_timestep"] == 200  # the env's episodes are longer than the folder's
    wrong = DATA.check({"name": "gym", "env": "cartpole", "path": str(tmp_path / "p")}, {})
    assert len(wrong) == 2 and "CartPole-v1 4" in wrong[0] and "Fix: data.env=" in wrong[1]


def test_a_folder_missing_a_column_is_refused_with_one_message(tmp_path) -> None:
    from datasets import Dataset

    rows = folder_rows([0] * 9)
    del rows["rewards"]
    rows["terminals"] = [int(t) for t in rows["terminals"]]
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "bad"))
    problems = DATA.check({"name": "gym", "path": str(tmp_path / "bad")}, {})
    assert len(problems) == 1
    text = problems[0]
    assert str(tmp_path / "bad") in text and "'rewards'" in text and "terminals is int" in text
    assert "its columns are observations, actions, terminals, timeouts" in text and "Fix:" in text
    with pytest.raises(ConfigError, match="rewards"):
        build(path=str(tmp_path / "bad")).prepare()
    missing = DATA.check({"name": "gym", "path": str(tmp_path / "nowhere")}, {})
    assert len(missing) == 1 and "does not exist" in missing[0] and "save_to_disk" in missing[0]


def test_a_dataset_dict_keeps_its_splits(tmp_path) -> None:
    from datasets import Dataset, DatasetDict

    one = Dataset.from_dict(folder_rows([0, 1, 0, 1, 0, 1, 0, 1, 0]))
    DatasetDict({"train": one, "validation": one, "test": one}).save_to_disk(str(tmp_path / "dd"))
    assert DATA.check({"name": "gym", "env": "cartpole", "path": str(tmp_path / "dd")}, {}) != []  # 2 values, not 4
    src = build(env=None, path=str(tmp_path / "dd"))
    src.prepare()
    assert all(sorted(src.episodes(s).lengths.tolist()) == [2, 3, 4] for s in ("train", "validation", "test"))


def test_top_fraction_keeps_the_best_training_episodes() -> None:
    full, top = build(env="acrobot", episodes=5), build(env="acrobot", episodes=5, top_fraction=0.4)
    full.prepare(), top.prepare()
    returns = np.sort(full.episodes("train").returns)[::-1]  # 3 policies x 3 training episodes
    assert len(returns) == 9 and len(top.episodes("train").lengths) == 4  # ceil(0.4 * 9)
    assert np.allclose(np.sort(top.episodes("train").returns)[::-1], returns[:4])
    assert np.array_equal(top.episodes("test").rewards, full.episodes("test").rewards)
    assert top.decision["return_scale"] == full.decision["return_scale"] == float(np.abs(returns).max())
    assert top.manifest["top_fraction_kept"]["kept"] == 4


@pytest.mark.parametrize("env", ["cartpole", "pendulum"])
def test_batches_feed_the_decision_embedding(sources, env: str) -> None:
    src = sources[env]
    assert src.task_for(src.params) == "decision" and src.seq_len == 8 and src.vocab_size == 0
    dm = XfamDataModule(src, seed=0)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))  # a DataLoader over the windows
    b, k = 16, 8
    layout = StepLayout.of(src.inputs)
    assert batch["inputs"].shape == (b, k, layout.width) and batch["step_mask"].shape == (b, k)
    if env == "cartpole":
        assert batch["labels"].dtype == torch.long and batch["labels"].shape == (b, k) and "targets" not in batch
        assert src.num_classes == 2
    else:
        assert batch["targets"].shape == (b, k, 1) and "labels" not in batch and src.target_dim == 1
    rows = [src.split("train")[0], src.split("train")[100]]  # a padded window and a full one
    padded = src.collate(rows)
    assert padded["key_padding"].shape == (2, 3 * k) and not padded["key_padding"][0, 0]
    if env == "cartpole":
        assert (padded["labels"][0, :-1] == -100).all()
    else:
        assert (padded["targets"][0, :-1] == 0).all()
    assert (padded["inputs"][0, :-1] == 0).all()
    out = DecisionEmbedding(layout, 16)(batch["inputs"])
    assert out.shape == (b, 3 * k, 16)
    assert src.decision["env"] == env and src.decision["returns"] is True
    assert set(src.decision["reference_returns"]) == {"random", "expert"}
    assert src.decision["reference_returns"]["expert"] > src.decision["reference_returns"]["random"]


def test_behaviour_cloning_drops_the_return_tokens(sources) -> None:
    src = build(env="cartpole", episodes=3, context=8, returns=False)
    src.prepare()
    assert src.inputs["returns"] is False and src.decision["returns"] is False
    batch = src.collate([src.split("train")[0]])
    assert batch["key_padding"].shape == (1, 2 * 8)
    assert DecisionEmbedding(StepLayout.of(src.inputs), 16)(batch["inputs"]).shape == (1, 16, 16)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"env": "lunar"}, "must be one of 'cartpole', 'acrobot', 'mountaincar', 'pendulum'"),
        ({"top_fraction": 0.0}, "data.top_fraction=0.0: must be > 0"),
        ({"top_fraction": 1.5}, "data.top_fraction=1.5: must be <= 1"),
        ({"context": 0}, "data.context=0: must be >= 1"),
        ({"policies": ["expert", "expert"]}, "name each behaviour policy once"),
        ({"policies": ["greedy"]}, "every item must be one of 'expert', 'noisy', 'random'"),
        ({"env": None}, "generated episodes need an environment"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_built(params: dict, expected: str) -> None:
    problems = DATA.check({"name": "gym", **params}, {})
    assert len(problems) == 1 and expected in problems[0], problems
