"""The compiled kernels' module with some of its functions' calls counted (the tests patch
``kernels.load`` to return one, so the CPU backend calls through it)."""


class CountedKernels:
    """``module``, every attribute its own, the calls to ``names`` counted in ``calls``."""

    def __init__(self, module, names):
        self.module, self.calls = module, dict.fromkeys(names, 0)

    def __getattr__(self, name):
        attr = getattr(self.module, name)
        if name in self.calls:

            def counted(*a, **k):
                self.calls[name] += 1
                return attr(*a, **k)

            return counted
        return attr
