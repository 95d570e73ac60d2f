"""AdamW and LAMB steps over the GPT-2-small parameter list (148 tensors, 124M f32 params).

Every implementation runs as a training loop does: jitted with the parameter and moment
buffers donated, so each step updates them in place (a `Step` keeps that state between calls;
the harness runs it as given). Ideal traffic: read w, g, m1, m2 and write w, m1, m2:
7 x 4 bytes per parameter. LAMB needs a second pass (norms, then the update); its target
(70% of copy bandwidth) allows for that, on the same byte count.

Peers: optax.adamw / optax.lamb under jit (donated), and torch.optim.AdamW(fused=True).
One timed call runs STEPS optimizer steps (one jit for jax, STEPS `step()`s for torch) and the
harness reports the time per step: a lone jitted call over ~600 buffers spends about as long in
host dispatch as the GPU spends updating them, which a training step (forward, backward and
update in one jit) hides. The check compares the first call's new embedding matrix with the f32
reference after STEPS steps.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import Case
from jaxops.reference import optim as ref

try:  # jaxops.optim and the peers need optax (the `test` extra)
    import optax

    from jaxops import optim as jo
except ImportError as e:
    optax = jo = None
    _MISSING = str(e)

FAMILY = "optim"
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
STEPS = 4  # optimizer steps per timed call


def gpt2_small_shapes(layers=12, d=768, vocab=50257, ctx=1024):
    """GPT-2 small's parameters in order: 2 embeddings, 12 per block, the final layer norm."""
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
             (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d)] + block * layers + [(d,), (d,)]


def _make_inputs(shapes):
    sizes = [math.prod(s) for s in shapes]
    offsets = np.cumsum([0] + sizes)

    def make(key):
        # One random draw per list, cut into the tensors: a draw per tensor (592 for GPT-2
        # small) took XLA over two minutes to compile on an H100.
        lists = []
        for k, scale in zip(jax.random.split(key, 4), (1.0, 1.0, 0.1, 0.01)):
            flat = scale * jax.random.normal(k, (int(offsets[-1]),), jnp.float32)
            flat = jnp.abs(flat) if scale == 0.01 else flat  # m2 >= 0
            lists.append([flat[a:b].reshape(s) for a, b, s in zip(offsets, offsets[1:], shapes)])
        return tuple(x for xs in lists for x in xs)
    return make


def _split(args, n):
    return [list(args[k * n:(k + 1) * n]) for k in range(4)]


class Step:
    """A donated, jitted optimizer step with its own state: the first call copies the inputs'
    (w, m1, m2) into the state; every call takes the gradients of the inputs it is given."""

    stateful = True

    def __init__(self, tx, n):
        self.tx, self.n, self.state = tx, n, None

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, grads):
            for _ in range(STEPS):
                if hasattr(tx, "step"):
                    params, opt_state = tx.step(grads, opt_state, params)
                else:
                    updates, opt_state = tx.update(grads, opt_state, params)
                    params = optax.apply_updates(params, updates)
                # A training step's forward and backward sit between two updates; without
                # the barrier XLA fuses optax's STEPS steps into one pass over the buffers
                # (157% of copy bandwidth on an H100).
                params, opt_state = jax.lax.optimization_barrier((params, opt_state))
            return params, opt_state

        self.step = step

    def __call__(self, *args):
        w, g, m1, m2 = _split(args, self.n)
        if self.state is None:
            opt_state = self.tx.init(w)
            self.state = ([jnp.copy(x) for x in w], _with_moments(opt_state, m1, m2))
        params, opt_state = self.step(*self.state, g)
        self.state = (params, opt_state)
        return params[0]


def _with_moments(state, m1, m2):
    """Puts copies of m1/m2 into an Adam-like state (jaxops' or optax's), found by structure."""
    copy = lambda xs: [jnp.copy(x) for x in xs]
    if isinstance(state, (jo.AdamState, jo.LambState)):
        return state._replace(mu=copy(m1), nu=copy(m2))
    if isinstance(state, optax.ScaleByAdamState):
        return state._replace(mu=copy(m1), nu=copy(m2))
    if isinstance(state, tuple):
        return type(state)(*(_with_moments(s, m1, m2) for s in state)) if hasattr(
            state, "_fields") else tuple(_with_moments(s, m1, m2) for s in state)
    return state


def _reference(kind, n):
    """The first tensor after STEPS steps (steps 1..STEPS) of the f32 reference."""
    def f(*args):
        w, g, m1, m2 = (x[0] for x in _split(args, n))
        lr = jnp.asarray([LR], jnp.float32)
        for t in range(1, STEPS + 1):
            if kind == "adamw":
                _, (w,), (m1,), (m2,) = ref.adamw_optimizer(
                    lr, jnp.asarray([t]), [w], [g], [m1], [m2], alpha=B1, beta=B2,
                    epsilon=EPS, weight_decay=WD)
            else:
                _, ((w, _, m1, m2, _),) = ref.lamb_optimizer(
                    None, None, None, lr[0], jnp.asarray(t), [(w, g, m1, m2, None)],
                    alpha=[B1], beta=[B2], lambda_=[WD], epsilon=[1e-6], max_norm_clip=[1.0])
        return w
    return f


def _torch_adamw(n):
    state = {}

    def call(torch, *tensors):
        if "opt" not in state:
            w, g, m1, m2 = _split(tensors, n)
            params = [torch.nn.Parameter(x.clone()) for x in w]
            opt = torch.optim.AdamW(params, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD,
                                    fused=True)
            for p, a, b in zip(params, m1, m2):  # start from the inputs' moments
                opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                "exp_avg": a.clone(), "exp_avg_sq": b.clone()}
            state.update(opt=opt, params=params)
        g = _split(tensors, n)[1]
        for p, x in zip(state["params"], g):
            p.grad = x
        for _ in range(STEPS):
            state["opt"].step()
        return state["params"][0].detach()
    return call


def case(kind, shapes, label):
    n = len(shapes)
    numel = sum(math.prod(s) for s in shapes)
    if kind == "adamw":
        ours = lambda: jo.adamw(LR, B1, B2, EPS, weight_decay=WD)
        theirs = {"optax": Step(optax.adamw(LR, B1, B2, EPS, weight_decay=WD), n)}
        torch = _torch_adamw(n)
    else:
        ours = lambda: jo.lamb(LR, B1, B2, 1e-6, weight_decay=WD)
        theirs = {"optax": Step(optax.lamb(LR, B1, B2, 1e-6, weight_decay=WD), n)}
        torch = None
    return Case(
        name=f"{kind}/f32/{label}", family=FAMILY, op=kind, dtype="f32", shape=(n, numel),
        params={"tensors": n, "params": numel, "steps_per_call": STEPS},
        make_inputs=_make_inputs(shapes), jaxops=Step(ours(), n),
        reference=_reference(kind, n), xla=theirs, torch=torch, bytes=7 * 4 * numel,
        steps_per_call=STEPS)


def cases(quick: bool) -> list[Case]:
    if optax is None:
        print(f"bench/optim: skipped ({_MISSING})")
        return []
    shapes = gpt2_small_shapes(layers=2, d=64, vocab=512, ctx=64) if quick else gpt2_small_shapes()
    label = "gpt2-tiny" if quick else "gpt2-small"
    return [case("adamw", shapes, label), case("lamb", shapes, label)]
