"""The compiled kernels' module with some of its functions' calls counted (the tests patch
``kernels.load`` to return one, so the CPU backend calls through it), and the instruction-set
levels a CPU has (the tests run each path)."""


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


def isa_levels(module) -> list[str]:
    """Each instruction-set path this CPU has, lowest first (arm64: scalar and neon), for
    ``module.set_max_isa``."""
    levels = ["scalar", "neon"] if module.best_isa == "neon" else ["scalar", "avx2", "avx512"]
    return levels[: levels.index(module.best_isa) + 1]
