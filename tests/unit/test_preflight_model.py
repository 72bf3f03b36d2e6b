"""A model named by a local path that is not a model directory stops the start at once."""

import pytest

from worker.preflight import StartupError, check_model


def test_a_missing_local_directory_is_named(tmp_path):
    for model in (str(tmp_path / "gone"), "./gone", ".sluice/models/not-prepared", "~/no-such-model-here"):
        with pytest.raises(StartupError, match=r"SLUICE_MODEL=.*no such directory.*sluice model prepare"):
            check_model(model)


def test_a_directory_without_a_config_is_not_a_model(tmp_path):
    with pytest.raises(StartupError, match="not a model directory"):
        check_model(str(tmp_path))


def test_a_model_directory_and_a_repository_id_pass(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    check_model(str(tmp_path))
    check_model("HuggingFaceTB/SmolLM2-135M-Instruct")  # left to vLLM: a repository id, not a path
    check_model("gpt2")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    check_model(str(tmp_path / "model.gguf"))  # vLLM loads a single GGUF file too


def test_a_file_that_is_not_gguf_is_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(StartupError, match="not a model directory"):
        check_model(str(tmp_path / "weights.bin"))
