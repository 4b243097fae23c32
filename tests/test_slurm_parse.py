"""The one reader of Slurm's output (ogrpo/launch/slurm/parse.py): scontrol's `Key=Value` records and Slurm time
strings.

These tables were written first against the parsers it replaced, and passed there (commit 861073d):
ogrpo.launch.slurm_cli.key_values (`scontrol show job|partition -o`), ogrpo.launch.grace.parse_config (`scontrol
show config`), the NodeAddr regex of ogrpo.launch.slurm.node_addr (`scontrol show node -o`),
ogrpo.launch.grace._seconds (KillWait/GraceTime) and ogrpo.launch.sbatch.parse_time (`--time`). Every form each
of them accepted is here with the value it gave; where they disagreed, the tests at the end say what is kept.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ogrpo.errors import OgrpoError
from ogrpo.launch import slurm as sl
from ogrpo.launch.slurm import grace, parse, sbatch

DATA = Path(__file__).parent / "data"


def words(text):
    return parse.key_values(text)


def config(text):
    return parse.key_values(text, lines=True)


def seconds(text):
    return parse.seconds(text)


def minutes(text):
    return sbatch.parse_time(text)


# ------------------------------------------------------------------ `Key=Value` words (scontrol show ... -o)


@pytest.mark.parametrize("text, expected", [
    ("JobId=5 JobName=x JobState=RUNNING Reason=None Restarts=0",
     {"JobId": "5", "JobName": "x", "JobState": "RUNNING", "Reason": "None", "Restarts": "0"}),
    ("A=1 A=2", {"A": "1"}),  # a repeated key: its first value
    ("AuthInfo=cred_expire=10", {"AuthInfo": "cred_expire=10"}),  # '=' inside a value stays
    ("NodeAddr= X=1", {"NodeAddr": "", "X": "1"}),  # an empty value
    ("foo A=1 bar", {"A": "1"}),  # words without '=' are skipped
    ("Comment=hello world A=1", {"Comment": "hello", "A": "1"}),  # a value with spaces is cut at the first
    ("A=1\nB=2\n", {"A": "1", "B": "2"}),  # several lines (records)
    ("PartitionName=debug\tDefault=YES   GraceTime=0", {"PartitionName": "debug", "Default": "YES",
                                                       "GraceTime": "0"}),
    ("", {}),
    ("   \n", {}),
])
def test_key_value_words(text, expected):
    assert words(text) == expected


# ------------------------------------------------------------ `Key = Value` lines (scontrol show config)


@pytest.mark.parametrize("text, expected", [
    ("KillWait                = 5 sec", {"KillWait": "5 sec"}),  # values keep their spaces
    ("AuthInfo                = socket=/x,cred_expire=10", {"AuthInfo": "socket=/x,cred_expire=10"}),
    ("Configuration data as of 2026-01-01T00:00:00\nKillWait = 30 sec", {"KillWait": "30 sec"}),
    ("Slurmctld(primary) at vm is UP", {}),
    ("Some Key = value\nA = 1", {"A": "1"}),  # a key with a space is no key
    ("= value\nA = 1", {"A": "1"}),  # nor an empty one
    ("SlurmctldHost[0]        = vm(127.0.0.1)", {"SlurmctldHost[0]": "vm(127.0.0.1)"}),
    ("Empty =\nB=2", {"Empty": "", "B": "2"}),
    ("  Padded   =   v  ", {"Padded": "v"}),
    ("", {}),
])
def test_key_value_lines(text, expected):
    assert config(text) == expected


def test_key_value_lines_of_a_real_scontrol_show_config():
    cfg = config((DATA / "scontrol_show_config.txt").read_text())
    assert len(cfg) == 193
    assert cfg["KillWait"] == "5 sec"
    assert cfg["ClusterName"] == "ci"
    assert cfg["SlurmctldHost[0]"] == "vm(127.0.0.1)"
    assert cfg["AuthInfo"].endswith("cred_expire=10")
    assert cfg["PreemptType"] == "preempt/none"


# ----------------------------------------------------------------------- NodeAddr (scontrol show node -o)


@pytest.mark.parametrize("rc, out, expected", [
    (0, "NodeName=gpu07 Arch=x86_64 NodeAddr=10.3.0.7 NodeHostName=gpu07 Version=22.05.8\n", "10.3.0.7"),
    (0, "NodeAddr=10.3.0.7 NodeName=gpu07", "10.3.0.7"),  # first word
    (0, "NodeName=gpu07 Arch=x86_64\n", "gpu07"),  # no NodeAddr: the node name
    (0, "", "gpu07"),
    (1, "NodeAddr=10.3.0.7", "gpu07"),  # scontrol failed: the node name
    (0, "NodeName=gpu07 OtherNodeAddr=1.2.3.4", "gpu07"),  # a longer key is another key
    (0, "NodeName=gpu07 NodeAddr=a=b", "a=b"),
])
def test_node_addr(monkeypatch, rc, out, expected):
    monkeypatch.setattr(sl.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, rc, out, ""))
    assert sl.node_addr("gpu07") == expected


# --------------------------------------------------------------------- time strings → seconds (scontrol)


@pytest.mark.parametrize("text, secs", [
    ("5 sec", 5), ("5 secs", 5), ("5sec", 5), ("5 s", 5), ("5s", 5), ("5 SEC", 5), ("  5 sec  ", 5),
    ("30", 30), ("0", 0),
    ("00:01:30", 90), ("1:2:3", 3723), ("1-00:00:00", 86400), ("2-03:04:05", 183845),
    ("NONE", None), ("UNLIMITED", None), ("unlimited", None), ("INFINITE", None), ("", None), (None, None),
    ("soon", None), ("-5", None), ("5 min", None),
])
def test_seconds(text, secs):
    assert seconds(text) == secs


# ----------------------------------------------------------------------- time strings → minutes (--time)


@pytest.mark.parametrize("text, mins", [
    ("90", 90), (45, 45), (" 90 ", 90),  # MM
    ("30:30", 31), ("1:00", 1), ("0:59", 1),  # MM:SS (rounded up)
    ("01:30:00", 90), ("0:0:59", 1), ("00:00:01", 1), ("10:00:00", 600),  # HH:MM:SS
    ("2-00", 2880), ("1-02", 1560),  # D-HH
    ("1-02:03", 1563),  # D-HH:MM
    ("1-02:03:04", 1564), ("0-00:00:30", 1),  # D-HH:MM:SS
])
def test_minutes(text, mins):
    assert minutes(text) == mins


@pytest.mark.parametrize("bad", ["soon", "1h", "0", "-5", "00:00:00", "0-0", "", "UNLIMITED", "5 sec", "1:2:3:4",
                                 "1-", "-1-00"])
def test_minutes_rejects(bad):
    with pytest.raises(OgrpoError, match="--time"):
        minutes(bad)


# ------------------------------------------------- the callers' names still give what they gave (the wrappers)


def test_the_callers_names_read_through_the_one_parser():
    assert grace.parse_config("KillWait = 5 sec\nA=1") == {"KillWait": "5 sec", "A": "1"}
    assert grace._seconds("5 sec") == 5 and grace._seconds("UNLIMITED") is None and grace._seconds(None) is None
    assert sl.parse_time("1-02:03") == 1563


# --------------------------------------------- where the old parsers disagreed: what the one parser keeps


def test_a_repeated_key_keeps_its_first_value_in_lines_too():
    # key_values (words) kept the first value, parse_config (lines) the last; `scontrol show config` prints each
    # key once (the plugin sections it appends after the main list name other keys), so no reader saw either
    assert config("A = 1\nA = 2") == {"A": "1"}
    assert words("A=1 A=2") == {"A": "1"}


def test_an_empty_key_is_no_key_in_words_too():
    # parse_config skipped `= value`; key_values kept `=x` under the key "" (nothing read it)
    assert words("=x A=1") == {"A": "1"}


@pytest.mark.parametrize("text, secs", [("01:30", 90), ("1-02", 93600), ("1-02:03", 93780)])
def test_seconds_reads_every_slurm_time_form(text, secs):
    # _seconds knew only N, N sec, HH:MM:SS and D-HH:MM:SS (None for the rest); parse_time also MM:SS, D-HH and
    # D-HH:MM: the one parser reads Slurm's whole grammar for both (scontrol prints KillWait as `N sec` and
    # GraceTime as plain seconds, so what scontrol gives is read as before)
    assert seconds(text) == secs


def test_a_bare_number_is_seconds_from_scontrol_and_minutes_for_sbatch():
    # the one real difference in meaning, Slurm's own: KillWait=30 is seconds, --time 30 is minutes
    assert parse.seconds("30") == 30
    assert parse.seconds("30", bare="minutes") == 1800
    assert parse.seconds("30 sec", bare="minutes") is None  # a unit is scontrol's, not sbatch's: --time refuses it
    with pytest.raises(ValueError):
        parse.seconds("30", bare="hours")


@pytest.mark.parametrize("stdout, job_id", [("12345\n", "12345"), ("12345;cluster\n", "12345"), (" 7 ", "7"),
                                            ("", None), ("Submitted batch job 5\n", None), ("x;y", None)])
def test_parsable_job_id(stdout, job_id):
    # what ogrpo.launch.slurm.submit and ogrpo.sweep.slurm._sbatch each read from `sbatch --parsable`
    assert parse.parsable_job_id(stdout) == job_id
