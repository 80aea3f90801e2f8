"""Orbax checkpoints of a training run: parameters, optimizer state, RNG and data
position together, the last N kept."""

from __future__ import annotations

from pathlib import Path

import jax

from dspine_jax.errors import CheckpointError


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unflat(flat: dict, like):
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[jax.tree_util.keystr(p)] for p, _ in paths])


class Checkpoints:
    def __init__(self, folder: Path, keep: int):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.folder = folder
        self.manager = ocp.CheckpointManager(
            folder.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, meta: dict) -> None:
        ocp = self.ocp
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_flat(state)), meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, like: dict) -> tuple[dict, dict]:
        ocp = self.ocp
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _flat(like))
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax/tensorstore raise many types on damaged files
            raise CheckpointError(
                f"checkpoint {step} in {self.folder} is unreadable ({type(e).__name__}: "
                f"{str(e)[:300]}). Nothing was overwritten; delete that step's folder to "
                "resume from an earlier one, or pick a new run.out.") from e
        return _unflat(got.state, like), got.meta

    def restore_meta(self, step: int) -> dict:
        """The JSON saved beside a checkpoint's state (no arrays are read)."""
        ocp = self.ocp
        try:
            return self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore())).meta
        except Exception as e:
            raise CheckpointError(f"checkpoint {step} in {self.folder} is unreadable "
                                  f"({type(e).__name__}: {str(e)[:300]})") from e

    def wait(self) -> None:
        self.manager.wait_until_finished()
