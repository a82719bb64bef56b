"""The `specd` command as a user runs it: up, generate, Ctrl-C, model-path."""

import signal
import subprocess
import sys

import pytest
from helpers import generate_json, wait_serving

from specd.launch import free_port, free_ports, health_status


def test_up_serves_and_ctrl_c_stops_all_three(tiny_model_dir):
    ports = free_ports(3)
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specd",
            "up",
            "--target",
            str(tiny_model_dir),
            "--port",
            str(ports[0]),
            "--verifier-port",
            str(ports[1]),
            "--drafter-port",
            str(ports[2]),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    address = f"127.0.0.1:{ports[0]}"
    try:
        wait_serving(address, up)
        _, result = generate_json(address, "--chat", "--prompt", "hi", "--max-tokens", "6")
        assert result["stats"]["generated_tokens"] >= 1
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(60)
    assert code == 0
    for port in ports:
        assert health_status(f"127.0.0.1:{port}", timeout_s=0.5) is None


def test_model_path_of_a_directory_and_a_missing_model(tiny_model_dir):
    run = [sys.executable, "-m", "specd", "model-path"]
    out = subprocess.run([*run, str(tiny_model_dir)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tiny_model_dir.resolve())
    bad = subprocess.run([*run, "/nonexistent/model.gguf"], capture_output=True, text=True)
    assert bad.returncode == 1 and "does not exist" in bad.stderr


def test_generate_against_nothing_says_unavailable():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specd",
            "generate",
            "--coordinator",
            f"127.0.0.1:{free_port()}",
            "--prompt",
            "hi",
            "--timeout",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-tokens", "99999999999"), ("--top-k", "99999999999"), ("--seed", "-1"),
     ("--num-draft-tokens", "99999999999")],
)  # fmt: skip
def test_generate_refuses_a_value_its_request_cannot_hold(flag, value):
    out = subprocess.run(
        [sys.executable, "-m", "specd", "generate", "--coordinator", f"127.0.0.1:{free_port()}",
         "--prompt", "hi", flag, value],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert f"specd: generate: {flag} must be between" in out.stderr
    assert "Traceback" not in out.stderr


def test_numeric_flags_are_checked_when_parsed(capsys):
    from specd.cli import build_parser

    parser = build_parser()
    ok = parser.parse_args(["serve", "drafter", "--blas-threads", "0"])
    assert ok.blas_threads == 0
    for argv in (
        ["serve", "drafter", "--blas-threads", "-1"],
        ["serve", "coordinator", "--decode-burst", "0"],
        ["bench", "--questions", "mt-bench", "--decode-burst", "x"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "must be at least 0, got -1" in err and "must be at least 1, got 0" in err
    assert "expected an integer, got 'x'" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "verifier", "--port", "70000"],
        ["serve", "verifier", "--port", "-1"],
        ["serve", "verifier", "--max-sessions", "0"],
        ["serve", "verifier", "--max-sessions", "3000000000"],
        ["serve", "verifier", "--session-idle-timeout", "-1"],
        ["serve", "drafter", "--num-draft-tokens", "3000000000"],
        ["serve", "drafter", "--tree-depth", "0"],
        ["serve", "drafter", "--block-size", "1"],
        ["serve", "coordinator", "--draft-timeout", "-1"],
        ["serve", "coordinator", "--default-max-tokens", "-5"],
        ["serve", "coordinator", "--metrics-port", "70000"],
        ["up", "--http-port", "70000"],
        ["bench", "--questions", "mt-bench", "--every", "0"],
        ["bench", "--questions", "mt-bench", "--max-tokens", "0"],
        ["train", "eagle3", "--out", "x", "--epochs", "0"],
        ["train", "eagle3", "--out", "x", "--save-every", "0"],
        ["train", "dflash", "--out", "x", "--layers", "0"],
        ["train", "dflash", "--out", "x", "--draft-vocab", "-5"],
        ["distill", "--out", "x", "--max-prompt-tokens", "0"],
        ["distill", "--out", "x", "--prompts", "self", "--prompt-temperature", "0"],
    ],
)
def test_out_of_range_flags_are_refused_when_parsed(argv, capsys):
    from specd.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_train_eagle3_takes_a_draft_vocabulary_chosen_from_its_data():
    from drafter_svc.eagle3.train import TrainOptions
    from specd.cli import build_parser

    args = build_parser().parse_args(["train", "eagle3", "--out", "x", "--vocab-from-data"])
    assert args.vocab_from_data is True and "vocab_from_data" in TrainOptions.__dataclass_fields__
    assert build_parser().parse_args(["train", "eagle3", "--out", "x"]).vocab_from_data is False


def _specd(*argv):
    return subprocess.run(
        [sys.executable, "-m", "specd", *argv], capture_output=True, text=True, timeout=120
    )


def test_up_refuses_two_services_on_one_port():
    out = _specd("up", "--port", "50195", "--verifier-port", "50195")
    assert out.returncode == 2 and "both 50195" in out.stderr


def test_a_service_that_cannot_start_says_why_without_a_traceback(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    bad_model = tmp_path / "bad.gguf"
    bad_model.write_text("not a gguf")
    for argv, needle in (
        (["serve", "drafter", "--port", "0", "--tls-cert", str(cert)], "--tls-key"),
        (["serve", "drafter", "--port", "0", "--auth-token-file", str(tmp_path)], "directory"),
        (["serve", "verifier", "--port", "0", "--model", str(bad_model)], "gguf"),
    ):
        out = _specd(*argv)
        assert out.returncode == 1, (argv, out.stderr)
        assert needle in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)


def test_bench_with_no_questions_says_so_before_starting_anything(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = _specd("bench", "--questions", str(empty))
    assert out.returncode == 1 and "no questions" in out.stderr
    out = _specd("bench", "--questions", "mt-bench", "--categories", "nothing")
    assert out.returncode == 1 and "no questions" in out.stderr


def test_flags_of_another_drafter_kind_and_empty_addresses_are_refused(tmp_path):
    out = _specd("serve", "drafter", "--kind", "ngram", "--block-size", "5", "--port", "0")
    assert out.returncode == 2 and "--block-size applies to dflash" in out.stderr
    out = _specd("serve", "drafter", "--kind", "ngram", "--tree-top-k", "3", "--port", "0")
    assert out.returncode == 2 and "--tree-top-k applies to eagle3 and dflash" in out.stderr
    out = _specd("serve", "drafter", "--kind", "ngram", "--draft-p-min", "0.5", "--port", "0")
    assert out.returncode == 2 and "--draft-p-min applies to eagle3" in out.stderr
    out = _specd("serve", "drafter", "--kind", "eagle3", "--draft-p-min", "1", "--port", "0")
    assert out.returncode == 2 and "must be >= 0 and < 1" in out.stderr
    out = _specd("serve", "drafter", "--kind", "ngram", "--tree-min-prob", "0.1", "--port", "0")
    assert out.returncode == 2 and "--tree-min-prob applies to eagle3 and dflash" in out.stderr
    out = _specd("serve", "drafter", "--kind", "dflash", "--tree-min-prob", "1", "--port", "0")
    assert out.returncode == 2 and "must be >= 0 and < 1" in out.stderr
    out = _specd("serve", "coordinator", "--verifier", "", "--port", "0")
    assert out.returncode == 2 and "HOST:PORT" in out.stderr
    config = tmp_path / "u.toml"
    config.write_text("[verifier]\nport = 50999\n")
    out = _specd("up", "--config", str(config), "--port", "5")
    assert out.returncode == 2 and "drop --port" in out.stderr


def test_a_host_that_does_not_resolve_is_named_as_such():
    out = _specd("serve", "drafter", "--host", "nosuchhost.invalid", "--port", "0")
    assert out.returncode == 1 and "does not resolve" in out.stderr


@pytest.mark.parametrize("service", ["verifier", "drafter", "coordinator"])
def test_each_service_default_is_its_config_dataclass_default(service):
    """Flags take their defaults from the config dataclass (written once): a service started
    with no flags runs with exactly the dataclass's configuration."""
    from coordinator.config import CoordinatorConfig
    from drafter_svc.config import DrafterConfig
    from specd.cli import _service_config, build_parser
    from verifier_svc.config import VerifierConfig

    config_type = {"verifier": VerifierConfig, "drafter": DrafterConfig,
                   "coordinator": CoordinatorConfig}[service]  # fmt: skip
    config, _ = _service_config(build_parser().parse_args(["serve", service]))
    assert config == config_type()


def test_byte_sizes():
    import argparse

    from specd.argtypes import byte_size

    assert byte_size("1") == 1 and byte_size("8GiB") == 8 * 2**30
    assert byte_size("512MiB") == 512 * 2**20 and byte_size("2GB") == 2 * 10**9
    assert byte_size("1.5kib") == 1536
    for bad in ("", "lots", "8 parsecs", "0", "-3GiB"):
        with pytest.raises(argparse.ArgumentTypeError, match="size|at least"):
            byte_size(bad)


@pytest.mark.parametrize("service", ["verifier", "drafter", "coordinator"])
def test_a_service_started_without_flags_gets_its_configs_defaults(service):
    """Flags are declared on the config fields (specd.options): with none given, the config a
    service starts with is its dataclass's default, field for field."""
    from specd.cli import _service_config, _service_configs, build_parser

    config, _ = _service_config(build_parser().parse_args(["serve", service]))
    assert config == _service_configs()[service]()


def test_declared_flags_set_their_fields():
    from specd.cli import _service_config, build_parser

    args = build_parser().parse_args(
        ["serve", "verifier", "--float32-weights", "--max-kv-memory", "1GiB",
         "--session-idle-timeout", "5", "--prefill-slice-tokens", "0", "--row-forwards", "off"]
    )  # fmt: skip
    config, _ = _service_config(args)
    assert (config.half_weights, config.max_kv_bytes, config.session_idle_timeout_s) == (
        False, 1 << 30, 5.0)  # fmt: skip
    assert config.prefill_slice_tokens == 0 and config.row_forwards == "off"
    args = build_parser().parse_args(
        ["serve", "coordinator", "--no-adaptive", "--overlap-drafting", "--drafter", "none",
         "--verifier-recovery-timeout", "7"]
    )  # fmt: skip
    config, _ = _service_config(args)
    assert not config.adaptive and config.overlap_drafting and config.drafter is None
    assert config.verifier_recovery_s == 7.0 and config.draft_beside_decode


def test_distill_with_openings_it_cannot_read_says_why_before_loading_a_model(tmp_path):
    out = _specd("distill", "--out", str(tmp_path / "x.jsonl"), "--prompts", "self",
                 "--prompt-leads", str(tmp_path / "missing.txt"))  # fmt: skip
    assert out.returncode == 1 and "--prompt-leads" in out.stderr
    assert "Traceback" not in out.stderr
