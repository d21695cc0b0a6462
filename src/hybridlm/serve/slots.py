"""Which request holds which row of the running batch: nothing else. The rows' state is the batch's
`InferenceCache`, whose cache kinds move it (place, free, concat); this table only says whose each row is."""


class RowTable:
    """The request of each row of the running batch, in row order (None: a free row)."""

    def __init__(self):
        self.rows: list = []

    @property
    def requests(self) -> list:
        """The requests in the batch (free rows left out)."""
        return [r for r in self.rows if r is not None]

    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is not None]

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is None]

    def holds(self, req) -> bool:
        return any(r is req for r in self.rows)

    def keep(self, reqs) -> list[int]:
        """Only `reqs` stay: the rows of the others become free; returns those rows."""
        wanted = {id(r) for r in reqs}
        gone = [i for i, r in enumerate(self.rows) if r is not None and id(r) not in wanted]
        for i in gone:
            self.rows[i] = None
        return gone

    def fill(self, i: int, req):
        self.rows[i] = req

    def compact(self, new: list):
        """The rows after a rebuild: the live ones in order, then `new` (None: a free row)."""
        self.rows = self.requests + list(new)

    def clear(self):
        self.rows = []
