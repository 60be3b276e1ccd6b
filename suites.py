"""Environments from other JAX suites as gymnax 1.0 environments, for both scripts'
`--env-id suites:SUITE/NAME`:

    python ppo_nnx_vae_lstm.py --env-id suites:xminigrid/MiniGrid-MemoryS8
    python ppo_nnx.py --env-id suites:popgym_arcade/CountRecallEasy-partial-32 --encoder conv
    python ppo_nnx.py --env-id suites:playground/CartpoleBalance

Each adapter steps the suite's own environment without its auto-reset and leaves the reset to
gymnax's `Environment.step`, which keeps the observation the step led to in
`info["final_observation"]`. `terminated` is true where the suite ends the episode, and
`truncated` where its time limit cuts one that did not end, so GAE bootstraps from the final
observation only there.
The suites are optional (requirements-envs.txt); each is imported when an env of it is named.
`python suites.py` says which are installed and checks that gymnax's own files are intact.
"""

import base64
import functools
import hashlib
import importlib
import importlib.metadata
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import environment, spaces

INSTALL = "pip install --no-deps -r requirements-envs.txt"


def suite(name: str):
    """The suite's module, or an ImportError that says how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"{error}; install the suites with: {INSTALL}") from None


class XMiniGrid(environment.Environment):
    """An xminigrid environment: its state is xminigrid's TimeStep, whose `discount` is 0 at a
    termination and 1 at the time limit."""

    def __init__(self, env_id: str):
        super().__init__()
        self.env, self.params = suite("xminigrid").make(env_id)

    @property
    def default_params(self):
        return self.params

    def reset_env(self, key, params):
        timestep = self.env.reset(params, key)
        return timestep.observation, timestep

    def step_env(self, key, timestep, action, params):
        timestep = self.env.step(params, timestep, action)
        terminated = timestep.last() & (timestep.discount == 0)
        return timestep.observation, timestep, timestep.reward, terminated, {}

    def is_truncated(self, timestep, params):
        return timestep.last() & (timestep.discount > 0)

    def observation_space(self, params):
        return spaces.Box(0, 255, self.env.observation_shape(params), jnp.uint8)

    def action_space(self, params):
        return spaces.Discrete(self.env.num_actions(params))


@struct.dataclass
class Tracked:
    """A suite's state with what gymnax's `step` asks of it: whether the time limit ended the
    episode (POPGym Arcade) or the steps taken so far (MuJoCo Playground)."""

    state: Any
    truncated: jax.Array
    time: jax.Array


class POPGymArcade(environment.Environment):
    """A POPGym Arcade game, whose info says "terminated" and "truncated". Its pixels come as
    float32 in [0, 1], mean-pooled to `size` pixels a side when that is given."""

    def __init__(self, game: str, partial: bool, size: int | None = None):
        super().__init__()
        self.env, self.params = suite("popgym_arcade").make(game, partial_obs=partial)
        self.size = size or self.env.obs_size
        if self.env.obs_size % self.size:
            raise ValueError(
                f"-{size} must divide {self.env.obs_size}, the game's pixels"
            )
        # its info's "discount" asks gymnax for is_terminated, which the games do not define
        self.env.discount = lambda state, params: jnp.float32(1.0)

    @property
    def default_params(self):
        return self.params

    def pixels(self, obs):
        pool = self.env.obs_size // self.size
        obs = obs.reshape(self.size, pool, self.size, pool, -1).mean(axis=(1, 3))
        return obs / 255.0

    def reset_env(self, key, params):
        obs, state = self.env.reset_env(key, params)
        return self.pixels(obs), Tracked(state, jnp.asarray(False), jnp.asarray(0))

    def step_env(self, key, tracked, action, params):
        obs, state, reward, done, info = self.env.step_env(
            key, tracked.state, action, params
        )
        # some games count their time limit in "terminated" too: "truncated" decides
        truncated = done & jnp.asarray(info.get("truncated", False), bool)
        terminated = done & jnp.asarray(info.get("terminated", True), bool) & ~truncated
        tracked = Tracked(state, truncated, tracked.time + 1)
        return self.pixels(obs), tracked, reward, terminated, {}

    def is_truncated(self, tracked, params):
        return tracked.truncated

    def observation_space(self, params):
        return spaces.Box(0.0, 1.0, (self.size, self.size, 3), jnp.float32)

    def action_space(self, params):
        return self.env.action_space(params)


@struct.dataclass
class TimeLimit:
    max_steps_in_episode: int


class Playground(environment.Environment):
    """A MuJoCo Playground environment in its JAX implementation (its default, warp, does not
    run under vmap on a CPU), with the episode length of its config as the time limit: the
    environment itself says `done` only when it terminates."""

    def __init__(self, env_id: str, **config):
        super().__init__()
        registry = suite("mujoco_playground").registry
        self.env = registry.load(env_id, config_overrides={"impl": "jax", **config})
        self.params = TimeLimit(self.env._config.episode_length)
        if not isinstance(self.env.observation_size, int):
            raise ValueError(
                "its observations are a dict; suites.py adapts arrays only"
            )

    @property
    def default_params(self):
        return self.params

    def reset_env(self, key, params):
        state = self.env.reset(key)
        return state.obs, Tracked(state, jnp.asarray(False), jnp.asarray(0))

    def step_env(self, key, tracked, action, params):
        state = self.env.step(tracked.state, action)
        tracked = Tracked(state, tracked.truncated, tracked.time + 1)
        return state.obs, tracked, state.reward, state.done > 0, {}

    def is_truncated(self, tracked, params):
        return (tracked.time >= params.max_steps_in_episode) & (tracked.state.done == 0)

    def observation_space(self, params):
        return spaces.Box(-jnp.inf, jnp.inf, (self.env.observation_size,), jnp.float32)

    def action_space(self, params):
        return spaces.Box(-1.0, 1.0, (self.env.action_size,), jnp.float32)


def popgym_arcade(name: str) -> POPGymArcade:
    """GAME (fully observable), GAME-partial, each optionally -SIZE: CountRecallEasy-partial-32."""
    game, *options = name.split("-")
    size = int(options.pop()) if options and options[-1].isdigit() else None
    if options not in ([], ["partial"]):
        raise AttributeError(f"popgym_arcade/{name}: expected GAME[-partial][-SIZE]")
    return POPGymArcade(game, partial=options == ["partial"], size=size)


# the suite's name in --env-id: (its adapter, the module it imports, the package pip installs)
SUITES = {
    "xminigrid": (XMiniGrid, "xminigrid", "xminigrid"),
    "popgym_arcade": (popgym_arcade, "popgym_arcade", "popgym-arcade"),
    "playground": (Playground, "mujoco_playground", "playground"),
}


def __getattr__(name: str):
    """`suites:SUITE/NAME` names an env: the scripts build it with `getattr(suites, name)()`."""
    suite_name, _, env_id = name.partition("/")
    if suite_name not in SUITES or not env_id:
        raise AttributeError(f"{name}; name one of {', '.join(SUITES)} as SUITE/NAME")
    return functools.partial(SUITES[suite_name][0], env_id)


def gymnax_files_changed() -> list[str]:
    """gymnax's installed files whose hashes differ from pip's record of the install: a suite
    that depends on another gymnax (stable-gymnax) writes over them."""
    distribution = importlib.metadata.distribution("gymnax")
    changed = []
    for file in distribution.files:
        if file.hash is None:
            continue
        path = pathlib.Path(distribution.locate_file(file))
        digest = hashlib.sha256(path.read_bytes() if path.exists() else b"").digest()
        expected = file.hash.value + "=" * (-len(file.hash.value) % 4)
        if digest != base64.urlsafe_b64decode(expected):
            changed.append(str(file))
    return changed


def main() -> int:
    for name, (_, _, package) in SUITES.items():
        try:
            print(f"{name}: {package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"{name}: not installed ({INSTALL})")
    changed = gymnax_files_changed()
    if changed:
        print(
            f"gymnax {importlib.metadata.version('gymnax')}: {len(changed)} files differ from "
            "its install, e.g. " + changed[0] + "; restore them with: "
            "pip install --force-reinstall --no-deps gymnax==1.0.1"
        )
        return 1
    print(f"gymnax {importlib.metadata.version('gymnax')}: files intact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
