"""Data-parallel linear regression in JAX: each rank takes the gradient on its own shard of the
data, and the ranks average their gradients with anyccl before every step.

JAX arrays are immutable, so the collectives are used in their functional form: the call
returns a new JAX array holding the result and leaves its input as it was.

    anyccl run -n 4 examples/jax_data_parallel.py
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import anyccl


def loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--samples", type=int, default=256, help="per rank")
    args = parser.parse_args()
    comm = anyccl.init()

    truth = np.array([2.0, -3.0, 0.5], np.float32)
    rng = np.random.default_rng(comm.rank)            # every rank its own shard of the data
    x = rng.normal(size=(args.samples, 3)).astype(np.float32)
    y = x @ truth + 1.0 + 0.01 * rng.normal(size=args.samples).astype(np.float32)
    x, y = jnp.asarray(x), jnp.asarray(y)

    params = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    # rank 0's start for everyone (the same here anyway): broadcast returns new arrays
    params = jax.tree_util.tree_map(lambda p: comm.broadcast(p, src=0), params)
    step = jax.jit(jax.value_and_grad(loss))
    for i in range(args.steps):
        value, grads = step(params, x, y)
        grads = jax.tree_util.tree_map(lambda g: comm.all_reduce(g, "avg"), grads)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        if i % 50 == 0 and comm.rank == 0:
            print(f"step {i:4d}: loss on rank 0's shard {float(value):.5f}")

    mine = np.concatenate([np.asarray(params["w"]), np.asarray(params["b"])[None]])
    everyone = comm.all_gather_object(mine.tolist())
    same = all(theirs == everyone[0] for theirs in everyone)
    if comm.rank == 0:
        print(f"w = {np.round(mine[:3], 3)}, b = {mine[3]:.3f} (truth {truth}, 1.0)")
        print(f"JAX on {comm.size} ranks: weights identical on every rank: {same}")
    comm.close()
    if not same or not np.allclose(mine[:3], truth, atol=0.05):
        raise SystemExit("the ranks did not train to the same, right weights")


if __name__ == "__main__":
    main()
