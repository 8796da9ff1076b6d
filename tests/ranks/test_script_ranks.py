"""``lab.launch.script_ranks`` runs a script as torchrun would: its environment, ``__main__``, the
interpreter's exit, one failing rank ending the launch.

The training tests launch ``pretrain_gpt_domino.py`` through it (``tests/launch.py``), so what
they prove about a torchrun launch rests on these properties. Each test writes a small script
and runs it on two forked ranks.
"""

from __future__ import annotations

import json
import os
import textwrap
import time

from lab.launch.script_ranks import run_script

#: Prints what torchrun would have given the rank, as one JSON line, and an atexit line.
PROBE = """
import atexit, json, multiprocessing, os, sys
import probe_neighbour  # next to the script: the script's folder is first on sys.path
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "PROBE_VALUE"]
if __name__ == "__main__":
    atexit.register(lambda: print(f"atexit rank {os.environ['RANK']}", flush=True))
    print(json.dumps(dict(
        env={key: os.environ.get(key) for key in keys},
        argv=sys.argv[1:],
        cwd=os.getcwd(),
        start_method=multiprocessing.get_start_method(),
        neighbour=probe_neighbour.VALUE,
    )), flush=True)
"""


def _write(tmp_path, text: str):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(text))
    (tmp_path / "probe_neighbour.py").write_text("VALUE = 7\n")
    return script


def test_each_rank_gets_torchruns_environment_and_runs_the_script_as_main(tmp_path):
    script = _write(tmp_path, PROBE)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PROBE_VALUE": "x"}
    result = run_script(script, ["--flag", "1"], nproc=2, cwd=work, env=env, timeout_s=120)
    assert result.returncode == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    by_rank = {line["env"]["RANK"]: line for line in lines}
    assert sorted(by_rank) == ["0", "1"], result.output
    ports = {line["env"]["MASTER_PORT"] for line in lines}
    assert len(ports) == 1
    for rank, line in by_rank.items():
        assert line["env"]["LOCAL_RANK"] == rank
        assert line["env"]["WORLD_SIZE"] == line["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert line["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert line["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert line["env"]["PROBE_VALUE"] == "x"
        assert line["argv"] == ["--flag", "1"] and line["cwd"] == str(work)
        assert line["start_method"] == "fork"  # the platform default, not the fork server's
        assert line["neighbour"] == 7
    assert "atexit rank 0" in result.output and "atexit rank 1" in result.output


def test_a_failing_rank_ends_the_launch_with_its_exit_code(tmp_path):
    """Rank 1 exits with 3 while rank 0 would wait 60 s: the launch ends early, code 3."""
    script = _write(
        tmp_path,
        """
        import os, sys, time
        if __name__ == "__main__":
            if os.environ["RANK"] == "1":
                print("rank 1 gives up", file=sys.stderr, flush=True)
                sys.exit(3)
            time.sleep(60)
        """,
    )
    started = time.monotonic()
    result = run_script(script, [], nproc=2, cwd=tmp_path, env=dict(os.environ), timeout_s=120)
    assert result.returncode == 3, result.output
    assert "rank 1 gives up" in result.output
    assert time.monotonic() - started < 40


def test_a_raising_script_fails_with_its_traceback(tmp_path):
    script = _write(
        tmp_path,
        """
        if __name__ == "__main__":
            raise ValueError("broken on purpose")
        """,
    )
    result = run_script(script, [], nproc=2, cwd=tmp_path, env=dict(os.environ), timeout_s=120)
    assert result.returncode == 1
    assert "ValueError: broken on purpose" in result.output


def test_the_time_limit_kills_every_rank(tmp_path):
    script = _write(
        tmp_path,
        """
        import time
        if __name__ == "__main__":
            time.sleep(60)
        """,
    )
    started = time.monotonic()
    result = run_script(script, [], nproc=2, cwd=tmp_path, env=dict(os.environ), timeout_s=3)
    assert result.returncode == -9
    assert time.monotonic() - started < 30
