import pytest

from worker.settings import SettingsError, load


def test_env_overrides_file(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('group_id = "from-file"\nmetrics_port = 1000\n')
    s = load(cfg, environ={"SLUICE_METRICS_PORT": "2000", "SLUICE_KAFKA_IDEMPOTENCE": "false"})
    assert (s.group.id, s.ops.metrics_port, s.kafka.idempotence) == ("from-file", 2000, False)


@pytest.mark.parametrize("env,named", [
    ({"SLUICE_METRICS_PORT": "abc"}, "SLUICE_METRICS_PORT"),
    ({"SLUICE_METRICS_PORT": "70000"}, "SLUICE_METRICS_PORT"),
    ({"SLUICE_REDIS_URL": "http://x"}, "SLUICE_REDIS_URL"),
    ({"SLUICE_REDIS_URL": "redis://a:1,b:port"}, "SLUICE_REDIS_URL"),
    ({"SLUICE_KAFKA_BOOTSTRAP": ""}, "SLUICE_KAFKA_BOOTSTRAP"),
    ({"SLUICE_GROUP_ID": ""}, "SLUICE_GROUP_ID"),
    ({"SLUICE_DEVICE": "tpu"}, "SLUICE_DEVICE"),
    ({"SLUICE_MAX_NESTING_DEPTH": "0"}, "SLUICE_MAX_NESTING_DEPTH"),
    ({"SLUICE_ENGINE_STALL_S": "-1"}, "SLUICE_ENGINE_STALL_S"),
    ({"SLUICE_CLASSES": "realtime,fast"}, "SLUICE_CLASSES"),
    ({"SLUICE_CLASSES": ""}, "SLUICE_CLASSES"),
    ({"SLUICE_GROUP_HEARTBEAT_INTERVAL_MS": "-1"}, "SLUICE_GROUP_HEARTBEAT_INTERVAL_MS"),
    ({"SLUICE_GROUP_HEARTBEAT_INTERVAL_MS": "10000"}, "SLUICE_GROUP_HEARTBEAT_INTERVAL_MS"),
    ({"SLUICE_GROUP_SESSION_TIMEOUT_MS": "3000", "SLUICE_GROUP_HEARTBEAT_INTERVAL_MS": "3000"},
     "SLUICE_GROUP_HEARTBEAT_INTERVAL_MS"),
])
def test_invalid_settings_name_the_variable(env, named):
    with pytest.raises(SettingsError, match=named):
        load(environ=env)


def test_unknown_key_in_file_is_an_error(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text("metrics_prot = 1\n")
    with pytest.raises(SettingsError, match="metrics_prot"):
        load(cfg, environ={})


def test_missing_config_file():
    with pytest.raises(SettingsError, match="not found"):
        load("/nonexistent.toml", environ={})


@pytest.mark.parametrize("env,heartbeat_ms", [
    ({}, 1000),  # at most 1 s: a survivor learns of a rebalance at its next heartbeat
    ({"SLUICE_GROUP_SESSION_TIMEOUT_MS": "3000"}, 1000),
    ({"SLUICE_GROUP_SESSION_TIMEOUT_MS": "1500"}, 500),  # a third of a short session timeout
    ({"SLUICE_GROUP_SESSION_TIMEOUT_MS": "60000"}, 1000),
    ({"SLUICE_GROUP_SESSION_TIMEOUT_MS": "3000", "SLUICE_GROUP_HEARTBEAT_INTERVAL_MS": "500"}, 500),
])
def test_heartbeat_follows_the_session_timeout_unless_set(env, heartbeat_ms):
    assert load(environ=env).group.heartbeat_ms() == heartbeat_ms
