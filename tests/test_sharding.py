"""`espo.sharding`: logical parameter axes, the rules that map them to the mesh, the errors of a
mesh that does not divide the model or the batch, and sharded == single-device results on 8
emulated CPU devices (in a subprocess: the device count is fixed when jax starts)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from espo import config as config_lib
from espo import model as model_lib
from espo import rollout as rollout_lib
from espo import sharding, testing, train_step, trainer
from espo.testing import raises_invalid

HERE = pathlib.Path(__file__).resolve().parent
# Every kind of parameter: a dense layer, MoE layers with a shared expert, q/k norms, untied head.
CFG = model_lib.ModelConfig(
    vocab_size=64, d_model=16, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
    num_experts=8, top_k=2, moe_ffn_dim=16, dense_layers=(0,), dense_ffn_dim=24,
    shared_expert_ffn_dim=8, qk_norm=True,
)  # fmt: skip


def _mesh(data=1, fsdp=1, expert=1):
    return AbstractMesh((data, fsdp, expert), sharding.AXES)


def test_logical_axes_of_every_kind_of_parameter():
    axes = sharding.logical_axes(model_lib.Model(CFG).param_shapes())
    dense, moe = axes["blocks_0"], axes["blocks_1"]
    assert axes["embed"] == ("vocab", "embed") and axes["lm_head"] == ("embed", "vocab")
    assert axes["final_norm"]["scale"] == ("norm",)
    assert dense["attn"]["q_proj"] == ("layers", "embed", "heads", "head_dim")
    assert dense["attn"]["k_proj"] == ("layers", "embed", "kv_heads", "head_dim")
    assert dense["attn"]["o_proj"] == ("layers", "heads", "head_dim", "embed")
    assert dense["attn"]["q_norm"]["scale"] == ("layers", "head_dim")
    assert dense["mlp"]["down_proj"] == ("layers", "mlp", "embed")
    assert moe["moe"]["gate_proj"] == ("layers", "expert", "embed", "mlp")
    assert moe["moe"]["down_proj"] == ("layers", "expert", "mlp", "embed")
    assert moe["moe"]["router"] == ("layers", "embed", "router")
    assert moe["moe"]["shared_expert"]["down_proj"] == ("layers", "mlp", "embed")
    assert moe["moe"]["shared_expert_gate"] == ("layers", "embed", None)


def test_per_layer_params_have_no_layers_axis():
    stacked = model_lib.Model(CFG).param_shapes()
    unrolled = jax.eval_shape(lambda p: model_lib.transformer.unstack_layers(CFG, p), stacked)
    axes = sharding.logical_axes(unrolled)
    assert axes["blocks_1_layer_1"]["moe"]["up_proj"] == ("expert", "embed", "mlp")


def test_rules_shard_experts_and_the_model_dimension():
    specs = jax.tree.map(
        lambda s: s.spec,
        sharding.param_shardings(_mesh(fsdp=2, expert=4), model_lib.Model(CFG).param_shapes()),
    )
    assert specs["blocks_1"]["moe"]["down_proj"] == P(None, "expert", None, "fsdp")
    assert specs["blocks_1"]["moe"]["router"] == P(None, "fsdp", None)
    assert specs["embed"] == P(None, "fsdp") and specs["final_norm"]["scale"] == P(None)
    # Other rules: the vocabulary along fsdp, experts replicated.
    rules = (("vocab", "fsdp"), ("expert", None))
    specs = jax.tree.map(
        lambda s: s.spec,
        sharding.param_shardings(_mesh(fsdp=2), model_lib.Model(CFG).param_shapes(), rules),
    )
    assert specs["lm_head"] == P(None, "fsdp")
    assert specs["blocks_1"]["moe"]["up_proj"] == P(None, None, None, None)


@pytest.mark.parametrize(
    ("layout", "axes"), [("experts", ("expert",)), ("experts_all", ("data", "fsdp", "expert"))]
)
def test_the_rollout_rules_shard_only_the_experts(layout, axes):
    """Each rollout layout splits the experts over its axes (all 8 devices for experts_all)
    and holds everything else whole; the sampler's model splits its experts over the same."""
    specs = jax.tree.map(
        lambda s: s.spec,
        sharding.param_shardings(
            _mesh(data=2, fsdp=2, expert=2),
            model_lib.Model(CFG).param_shapes(),
            sharding.rollout_rules(layout),
        ),
    )
    moe = specs["blocks_1"]["moe"]
    assert moe.pop("down_proj") == moe.pop("up_proj") == P(None, axes, None, None)
    assert moe.pop("gate_proj") == P(None, axes, None, None)
    rest = {p for p in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))}  # popped
    assert all(set(p) <= {None} for p in rest), rest  # everything else whole on every device
    cfg = testing.load_script(HERE.parent / "configs" / "default.py").get_config("tiny")
    cfg.rollout.param_layout, cfg.rollout.dtype = layout, "bfloat16"
    s = config_lib.Settings.from_config(cfg)
    model = trainer.sampler_model_config(s, s.model)
    assert model.expert_axes == axes and model.dtype == "bfloat16"
    cfg.rollout.param_layout = "training"
    s = config_lib.Settings.from_config(cfg)
    assert trainer.sampler_model_config(s, s.model).expert_axes == ("expert",)
    assert set(sharding.EXPERT_AXES) == set(rollout_lib.PARAM_LAYOUTS) - {"training"}


def test_a_mesh_that_does_not_divide_the_experts_or_the_model_names_them():
    params = model_lib.Model(CFG).param_shapes()
    with pytest.raises(
        ValueError,
        match=r"does not divide parameter \['blocks_1'\]\['moe'\]\['down_proj'\]: its 'expert' "
        r"dimension has size 8, not a multiple of mesh axes expert \(size 3\)",
    ):
        sharding.param_shardings(_mesh(expert=3), params)
    with pytest.raises(ValueError, match=r"'embed' dimension has size 16, not a multiple .* 3"):
        sharding.param_shardings(_mesh(fsdp=3), params)
    sharding.param_shardings(_mesh(fsdp=4, expert=8), params)  # divides: no error


def test_a_mesh_that_does_not_divide_the_batch_names_the_axes():
    # The expert axis splits the batch too (the dense layers are not computed twice).
    with pytest.raises(ValueError, match=r"data=2 x fsdp=3 x expert=1 = 6 does not divide the b"):
        sharding.check_batch(_mesh(data=2, fsdp=3), 8)
    with pytest.raises(ValueError, match=r"data=1 x fsdp=2 x expert=3 = 6 does not divide"):
        sharding.check_batch(_mesh(fsdp=2, expert=3), 12 + 4)
    sharding.check_batch(_mesh(data=2, fsdp=2, expert=2), 8)


def test_an_unknown_parameter_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"blocks_0/attn/bias has no logical axes"):
        sharding.logical_axes({"blocks_0": {"attn": {"bias": jax.ShapeDtypeStruct((2, 3), "f4")}}})
    # A shape that contradicts its name: k_proj is [embed, kv_heads, head_dim].
    with pytest.raises(ValueError, match=r"k_proj of shape \(16, 8\) does not match"):
        sharding.logical_axes({"k_proj": jax.ShapeDtypeStruct((16, 8), "f4")})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sharded_steps_equal_the_single_device_run():
    env = testing.emulated_devices_env(8)
    # One mesh keeps the suite short: (2, 2, 2) shards all three axes at once;
    # `python tests/sharded_steps.py` alone runs all of MESHES (8,1,1), (2,2,2), (1,2,4), (2,1,4).
    r = subprocess.run(
        [sys.executable, str(HERE / "sharded_steps.py"), "2,2,2"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.count("equal to one device") == 1, r.stdout


def test_mesh_config_errors_name_the_key():
    def settings(**mesh):
        cfg = testing.load_script(HERE.parent / "configs" / "default.py").get_config("tiny")
        cfg.mesh.update(mesh)
        return config_lib.Settings.from_config(cfg)

    assert settings(data=2, expert=-1).mesh == sharding.MeshConfig(data=2, fsdp=1, expert=-1)
    with raises_invalid("expert", where="--config.mesh", kind=config_lib.ConfigError):
        settings(expert=0)
    with raises_invalid("fsdp", where="--config.mesh", kind=config_lib.ConfigError):
        settings(data=-1, fsdp=-1)


def test_distributed_config_errors_name_the_key():
    cfg = testing.load_script(HERE.parent / "configs" / "default.py").get_config("tiny")
    cfg.distributed.update(coordinator="127.0.0.1:1234", num_processes=2, process_id=2)
    with raises_invalid("process_id", where="--config.distributed", kind=config_lib.ConfigError):
        config_lib.Settings.from_config(cfg)
    cfg.distributed.process_id = 1
    assert config_lib.Settings.from_config(cfg).distributed.process_id == 1


def test_optimizer_state_follows_its_params():
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    make = lambda p: train_step.TrainState(
        step=jnp.zeros((), jnp.int32), params=p, opt_state=opt.init(p), ref_params=p
    )
    state = jax.eval_shape(make, model_lib.Model(CFG).param_shapes())
    sh = sharding.state_shardings(_mesh(fsdp=2, expert=4), opt, state)
    want = P(None, "expert", "fsdp", None)
    adam = sh.opt_state[1][0]
    for tree in (sh.params, sh.ref_params, adam.mu, adam.nu):
        assert tree["blocks_1"]["moe"]["up_proj"].spec == want
    assert adam.count.spec == P() and sh.step.spec == P()
