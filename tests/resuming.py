"""A LocalContext that restarts a run as Ray Train would, for in-process resume tests."""

from raydp_train.train.context import LocalContext


class ResumingContext(LocalContext):
    """Keeps every epoch's checkpoint; restores the one it is given, as Ray Train would."""

    def __init__(self, restore_from=None):
        super().__init__(on_epoch=lambda row: None)
        self.states, self.restore_from = [], restore_from

    def restore(self):
        return self.restore_from

    def report(self, row, state):
        self.states.append(state)
