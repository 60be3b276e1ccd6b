"""Where one PPO iteration spends its time: each phase compiled and timed on its own, with the
number of operations XLA keeps in it after optimization.

    python benchmarks/phases.py [SCRIPT] [FLAGS...]     # default: ppo_nnx, CleanRL's CartPole

Phases: one rollout step (network, sampling, env step, statistics), the whole rollout, the
bootstrap values and GAE, one minibatch's forward and backward pass, one optimizer step, the whole
update (epochs x minibatches, with the shuffles and gathers), and the whole iteration. Each time is
the median of 20 calls after a warm-up; the phases run as separate programs, so their sum is more
than the iteration's own time (a call's dispatch, and fusions that cross phases). Last, a trace
of 10 whole iterations (jax.profiler): the time of every XLA thunk, grouped by how often it runs.
"""

import importlib
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import tyro
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
argv = sys.argv[1:]
name = argv.pop(0) if argv and not argv[0].startswith("-") else "ppo_nnx"
P = importlib.import_module(name)
args = P.check_args(tyro.cli(P.Args, args=argv))
env, env_params = P.make_env(args)
optimizer, _ = P.make_optimizer(args)


def operations(compiled) -> Counter:
    """Operations in the optimized HLO (not counting parameters, constants, tuples)."""
    ops = re.findall(r"=\s*\S+\s+([a-z][\w-]*)\(", compiled.as_text())
    return Counter(
        op
        for op in ops
        if op not in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
    )


def profile(label: str, fn, *inputs, per: int = 1):
    """Time a compiled call (median of 20 after a warm-up), per `per` repetitions inside it."""
    compiled = jax.jit(fn).lower(*inputs).compile()
    jax.block_until_ready(compiled(*inputs))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    ops = operations(compiled)
    print(
        f"| {label} | {statistics.median(times) * 1e6 / per:,.1f} | {sum(ops.values())} "
        f"| {ops['fusion']} | {', '.join(f'{k} {v}' for k, v in ops.most_common(4))} |",
        flush=True,
    )
    return compiled(*inputs)


def repeated(step, times: int):
    """`step(carry) -> carry`, `times` times in a lax.scan: the call's own cost is shared out."""
    return lambda carry: jax.lax.scan(
        lambda c, _: (step(c), None), carry, length=times
    )[0]


key = jax.random.key(1, impl="philox2x32")
model = P.build_model(args, env, env_params, nnx.Rngs(key))
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
    jax.random.split(key, args.num_envs), env_params
)
norm = P.init_norm(P.observe(obs, args), args)
runner = P.Runner(
    env_state=env_state,
    obs=P.observe(obs, args, norm),
    carry=model.initialize_state(args.num_envs),
    episode_return=jnp.zeros(args.num_envs),
    episode_length=jnp.zeros(args.num_envs, int),
    key=key,
    norm=norm,
)
one_step = P.dataclasses.replace(args, num_steps=1)
opt_state = optimizer.init(params)

print(
    f"{name}, {args.env_id}, {args.num_envs} envs x {args.num_steps} steps, "
    f"{args.update_epochs} epochs x {args.num_minibatches} minibatches, hidden "
    f"{args.hidden_size}; jax {jax.__version__}\n"
)
print("| phase | time per repetition (us) | operations | fusions | most frequent |")
print("| --- | --- | --- | --- | --- |")
profile(
    "an empty call (the dispatch every call below pays once)",
    lambda x: x + 1,
    jnp.zeros(()),
)
profile(
    "rollout, one step, called alone",
    lambda p, r: P.rollout(graphdef, p, rest, env, env_params, r, one_step)[0],
    params,
    runner,
)
runner, t = profile(
    f"rollout step, of {args.num_steps} in a scan",
    lambda p, r: P.rollout(graphdef, p, rest, env, env_params, r, args),
    params,
    runner,
    per=args.num_steps,
)


def gae(p, t):
    return P.compute_gae(t, P.bootstrap_values(P.merge(graphdef, p, rest), t), args)


advantages, returns = profile("bootstrap values + GAE, called alone", gae, params, t)
profile(
    "bootstrap values + GAE, of 100 in a scan",
    repeated(
        lambda c: (c[0], c[1]._replace(reward=gae(c[0], c[1])[0] * 1e-9 + c[1].reward)),
        100,
    ),
    (params, t),
    per=100,
)
batch = P.rollout_batch(t, advantages, returns)
minibatch = jax.tree.map(
    lambda x: x[0],
    P.split_minibatches(
        batch,
        jnp.arange(args.num_envs if "lstm" in name else args.batch_size),
        args.num_minibatches,
    ),
)


def grad(p):
    return jax.grad(P.ppo_loss, argnums=1, has_aux=True)(
        graphdef, p, rest, minibatch, args
    )[0]


grads = profile("one minibatch: forward + backward, called alone", grad, params)
profile(
    "one minibatch: forward + backward, of 100 in a scan",
    repeated(lambda p: jax.tree.map(lambda x, g: x - 1e-9 * g, p, grad(p)), 100),
    params,
    per=100,
)
profile(
    "one optimizer step, of 100 in a scan",
    repeated(
        lambda c: (lambda u, s: (optax.apply_updates(c[0], u), s))(
            *optimizer.update(grads, c[1], c[0])
        ),
        100,
    ),
    (params, opt_state),
    per=100,
)
minibatches = args.update_epochs * args.num_minibatches
profile(
    f"update (shuffles, gathers, {minibatches} minibatch steps), per minibatch",
    lambda p, s, b, k: P.update(graphdef, p, rest, optimizer, s, b, k, args),
    params,
    opt_state,
    batch,
    key,
    per=minibatches,
)
train = P.make_train(P.dataclasses.replace(args, total_timesteps=args.batch_size * 10))
profile("whole iteration, of 10 in a train", lambda k: train(k)[1], key, per=10)

# Per XLA operation: the whole train traced by jax.profiler, each thunk's time summed over the
# run and grouped by how many times it runs per iteration (1: once, num_steps: a rollout step...;
# what runs once per train, like the initialization, lands in 1, a tenth of its time each).
# The profiler adds about 0.7 us to every thunk it records: the small ones read high. Loops,
# conditionals and calls are left out: their time is their thunks'.
iterations = 10
train = jax.jit(train)
jax.block_until_ready(train(key))
with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
        jax.block_until_ready(train(key))
    trace = jax.profiler.ProfileData.from_file(
        str(next(Path(folder).rglob("*.xplane.pb")))
    )
total, count = Counter(), Counter()
for line in (
    line for plane in trace.planes for line in plane.lines if "XLAEigen" in line.name
):
    for event in line.events:
        total[event.name] += event.duration_ns / iterations / 1e3
        count[event.name] += 1 / iterations
groups = {}
for name in total:
    if not name.startswith(
        (
            "ThunkExecutor",
            "while",
            "conditional",
            "call",
            "Threadpool",
            "SlinkyThreadPool",
        )
    ):
        groups.setdefault(max(1, round(count[name])), []).append(name)
print(
    "\n| runs per iteration | thunks | us per iteration (traced) | the largest (us per run) |"
)
print("| --- | --- | --- | --- |")
for runs, names in sorted(groups.items()):
    names.sort(key=lambda n: -total[n])
    print(
        f"| {runs} | {len(names)} | {sum(total[n] for n in names):,.0f} | "
        + ", ".join(f"{n} {total[n] / count[n]:.1f}" for n in names[:4])
        + " |"
    )
