"""EnvOverlay: a lab's changes to os.environ are undone exactly (absent names removed, old values back)."""

import os

from common.lab.environ import EnvOverlay, has_secret


def test_restore_puts_back_old_values_and_removes_new_names(monkeypatch):
    monkeypatch.setenv("PRFAAS_T_OLD", "before")
    monkeypatch.delenv("PRFAAS_T_NEW", raising=False)
    env = EnvOverlay()
    env.set("PRFAAS_T_OLD", "a")
    env.set("PRFAAS_T_OLD", "b")  # the value before the first change is what comes back
    env.update({"PRFAAS_T_NEW": "x"})
    assert os.environ["PRFAAS_T_OLD"] == "b" and os.environ["PRFAAS_T_NEW"] == "x" and env.changed
    env.restore()
    assert os.environ["PRFAAS_T_OLD"] == "before" and "PRFAAS_T_NEW" not in os.environ
    assert not env.changed
    os.environ["PRFAAS_T_OLD"] = "later"
    env.restore()  # idempotent: a second restore changes nothing
    assert os.environ["PRFAAS_T_OLD"] == "later"


def test_has_secret_reads_any_of_the_three_names():
    assert not has_secret({})
    assert has_secret({"PRFAAS_SHARED_SECRET": "s"})
    assert has_secret({"PRFAAS_SHARED_SECRET_FILE": "/f"})
    assert has_secret({"PRFAAS_CREDENTIALS_FILE": "/c"})
    assert not has_secret({"PRFAAS_SHARED_SECRET": ""})
