"""One deployment file read by `specd up --config` and by each `specd serve --config`."""

import signal
import subprocess
import sys

from helpers import generate_json, wait_serving

from specd.launch import free_ports, health_status


def write_config(path, tiny_model_dir, ports) -> None:
    path.write_text(f"""
[verifier]
port = {ports[1]}
model = "{tiny_model_dir}"
max-sessions = 8

[drafter]
port = {ports[2]}
kind = "ngram"
num_draft_tokens = 4

[coordinator]
port = {ports[0]}
verifier = "127.0.0.1:{ports[1]}"
drafter = "127.0.0.1:{ports[2]}"
adaptive = false
""")


def test_up_with_a_deployment_file(tiny_model_dir, tmp_path):
    ports = free_ports(3)
    config = tmp_path / "specd.toml"
    write_config(config, tiny_model_dir, ports)
    up = subprocess.Popen(
        [sys.executable, "-m", "specd", "up", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    address = f"127.0.0.1:{ports[0]}"
    try:
        wait_serving(address, up)
        _, result = generate_json(address, "--prompt", "abcabc", "--max-tokens", "12")
        assert result["stats"]["generated_tokens"] == 12
    finally:
        up.send_signal(signal.SIGTERM)  # as a service manager stops it
        assert up.wait(60) == 0
    for port in ports:  # and its services went with it
        assert health_status(f"127.0.0.1:{port}", timeout_s=0.5) is None


def test_unknown_option_in_the_file_is_an_error(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[verifier]\nmax_sesions = 3\n")
    out = subprocess.run(
        [sys.executable, "-m", "specd", "serve", "verifier", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "max_sesions" in out.stderr
    config.write_text("[verifer]\n")
    out = subprocess.run(
        [sys.executable, "-m", "specd", "up", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "verifer" in out.stderr


def test_file_values_are_checked_as_their_flags_are(tmp_path):
    from specd.cli import _parse

    config = tmp_path / "d.toml"
    for table, needle in (
        ("[coordinator]\ndecode_burst = 0\n", "decode-burst: must be at least 1"),
        ('[verifier]\ndtype = "int8"\n', "dtype must be one of"),
        ('[coordinator]\nadaptive = "yes"\n', "adaptive must be true or false"),
        ("[verifier]\nport = 70000\n", "must be at most 65535"),
        ("[verifier]\nport = [1, 2]\n", "must be a single value"),
    ):
        config.write_text(table)
        service = table[1 : table.index("]")]
        out = subprocess.run(
            [sys.executable, "-m", "specd", "serve", service, "--config", str(config)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 2 and needle in out.stderr, (table, out.stderr)
        assert f"usage: specd serve {service}" in out.stderr
    config.write_text("[coordinator]\nadaptive = false\ndecode_burst = 2\nport = 50999\n")
    args = _parse(["serve", "coordinator", "--config", str(config)])
    assert (args.adaptive, args.decode_burst, args.port) == (False, 2, 50999)


def test_a_file_that_names_no_service_is_refused(tmp_path):
    config = tmp_path / "empty.toml"
    config.write_text("# nothing yet\n")
    out = subprocess.run(
        [sys.executable, "-m", "specd", "up", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "names no service" in out.stderr
