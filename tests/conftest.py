"""Tests that hold for both scripts take the fixture `P`: once per script module."""

import pytest

import ppo_nnx
import ppo_nnx_vae_lstm


@pytest.fixture(params=[ppo_nnx, ppo_nnx_vae_lstm], ids=lambda module: module.__name__)
def P(request):
    return request.param
