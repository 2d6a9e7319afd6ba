"""The write-ahead record of steps spent: durable, additive, and read back by a new process."""

from raydp_train.train.charges import ChargeLedger


def test_charges_add_up_and_survive_a_new_ledger(tmp_path):
    first = ChargeLedger(str(tmp_path))
    assert first.charge(10) == 10
    assert first.charge(13) == 23
    # A restarted worker group opens the same run directory: nothing recorded is lost,
    # and its new charge counts once.
    restarted = ChargeLedger(str(tmp_path))
    assert restarted.total() == 23
    assert restarted.charge(13) == 36
    assert ChargeLedger(str(tmp_path)).total() == 36
    assert len(list((tmp_path / "charges").glob("*.json"))) == 3


def test_an_unfinished_write_is_not_counted(tmp_path):
    ledger = ChargeLedger(str(tmp_path))
    ledger.charge(4)
    (tmp_path / "charges" / ".partial.json.tmp").write_text('{"steps": 99}')
    assert ChargeLedger(str(tmp_path)).total() == 4
