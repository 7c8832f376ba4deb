"""The RL example (`examples/grpo_tiny_py.py`): its loss against hand-computed values,
and two iterations of its loop on the engine."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_tiny_py.py"


@pytest.fixture(scope="module")
def grpo():
    spec = importlib.util.spec_from_file_location("grpo_tiny_py", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_reward(grpo) -> None:
    assert grpo.reward("") == 0.0
    assert grpo.reward("a1b2") == 0.5
    assert grpo.reward("2024") == 1.0


def test_group_advantages_by_hand(grpo) -> None:
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 3.0]])
    # Row 0: mean 0.5, std 0.5. Row 1: all equal, so zeros. Row 2: mean 0.75, std
    # sqrt((3 * 0.75^2 + 2.25^2) / 4) = sqrt(1.6875).
    s = math.sqrt(1.6875)
    want = np.array(
        [
            [0.5 / 0.5, -0.5 / 0.5, -0.5 / 0.5, 0.5 / 0.5],
            [0.0, 0.0, 0.0, 0.0],
            [-0.75 / s, -0.75 / s, -0.75 / s, 2.25 / s],
        ]
    )
    np.testing.assert_allclose(grpo.group_advantages(rewards), want, rtol=1e-5)


def test_policy_gradient_loss_by_hand(grpo) -> None:
    logps = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.5, -7.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the -7 is not a completion token
    advantages = jnp.array([2.0, -1.0])
    # Per-sequence mean logps: -2 and -1; loss = -(2 * -2 + -1 * -1) / 2 = 1.5.
    assert float(grpo.policy_gradient_loss(logps, mask, advantages)) == pytest.approx(1.5)
    # d loss / d logps[i, t] = -advantage_i * mask[i, t] / (num tokens_i * num sequences).
    grad = jax.grad(grpo.policy_gradient_loss)(logps, mask, advantages)
    want = np.array([[-2 / 6, -2 / 6, -2 / 6], [1 / 4, 1 / 4, 0.0]])
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6)


# Prompts after which the model writes some digits, so that the rewards of a group
# differ, the advantages are not all zero and the first step changes the weights.
DIGIT_PROMPTS = ("x = [1, 2, 3, ", "PORT = 80")


def test_two_iterations_on_the_engine(grpo) -> None:
    result = grpo.run(iterations=2, group_size=4, max_tokens=8, prompts=DIGIT_PROMPTS)
    its = result.iterations
    assert its[0].loss != 0.0  # a real step: an engine left on the old weights fails below
    assert [it.iteration for it in its] == [0, 1]
    assert [it.weight_version for it in its] == [1, 2]  # update_weights every iteration
    assert result.warmup_compilations > 0
    assert [it.num_compilations for it in its] == [result.warmup_compilations] * 2
    for it in its:
        assert math.isfinite(it.loss)
        assert 0.0 <= it.mean_reward <= 1.0
        # The engine's logprobs of what it sampled equal the trainer's under the same
        # weights: in iteration 1, the weights update_weights installed.
        assert it.logprob_gap < 1e-4, it


def test_script_defines_its_flags() -> None:
    """Run as a script, it defines its flags (absl's --helpshort lists them and exits 1)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--helpshort"], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    for flag in ("--iterations", "--group_size", "--seed", "--json_out", "--learning_rate"):
        assert flag in result.stdout, result.stdout
