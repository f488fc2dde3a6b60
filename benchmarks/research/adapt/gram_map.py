"""Issue 32, fifth round: can a run move its old classes' statistics to adapted features with what it
already stores, without rows or Gaussian draws?

``drift.py`` maps old classes' *rows* (which a run does not keep) and draws class Gaussians (which lose
2 points even with no drift). A run keeps the ridge head's sums G = Σ φφᵀ and Q = Σ φyᵀ (φ = ReLU(hR),
M = 3000) and the class moments of x = f_0/‖f_0‖. Both move exactly under a linear map: φ' = φT gives
G' = TᵀGT and Q' = TᵀQ; x' = xT_x + b gives μ' = μT_x + b and S' = T_xᵀST_x. This fits T on the newest
stages' images only (φ before and after the adaptation, ridge on the residual φ' − φ in its dual form,
n ≪ M), applies it to everything stored after the last stage before them, and replays B0 Inc10 through
the product's own ``fit_stage``: stages before ``--fit-stages`` on the features before, the rest and
every test image on the features after. Prints A_T (capped and full) for each ridge κ (λ = κ times
the fit images' mean ‖φ‖²; "none": the stale statistics, nothing moved).

    python gram_map.py --data SKETCH --before sk_all.pt --after joint-ce20-1993-f32.pt --seed 1993 --fit-stages 10,11

``--carry gaussian`` asks instead whether class Gaussians (class-level statistics a run may keep) lose
only by sampling: each old class's rows of h = [f_0, layout] are moved by ``drift.py``'s per-token ridge
map (a linear map moves a Gaussian's mean and covariance exactly), and G and Q of the old classes are
replaced by n_c E[φφᵀ] and n_c E[φ] under the Gaussian with those rows' mean and covariance (and
the class moments of x by those of its draws), estimated
from k · n_c draws each weighted 1/k (``--draws``; large k: the expectation itself; "rows": the moved
rows themselves, the bound of this route). With ``--after`` equal to ``--before`` (no drift) it
measures what the Gaussian alone loses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cov_rank"))
from drift import move_tokens, ridge_map  # noqa: E402
from replay import plan, stage_scores  # noqa: E402

from drlcli.config import RunConfig  # noqa: E402
from drlcli.heads.ridge import COV_COVARIANCE, COV_MEAN, COV_SCATTER, COV_SHARED, PROJECTION  # noqa: E402
from drlcli.heads.ridge.carry import ClassGaussians, TokenMaps  # noqa: E402
from drlcli.heads.ridge.sums import expected_sums  # noqa: E402
from drlcli.heads.ridge.covariance import covariance_input  # noqa: E402
from drlcli.heads.ridge.head import expand, head_input  # noqa: E402
from drlcli.heads.ridge.statistics import STAT_DTYPE, pack, unpack, validation_mask  # noqa: E402
from drlcli.metrics import accuracy_report  # noqa: E402

RANK = 16


def phi_map(x: torch.Tensor, y: torch.Tensor, kappa: float) -> torch.Tensor:
    """T (M, M) with y ≈ x T, T = I + B, B by ridge on the residual y − x (dual form: n ≪ M; B shrinks
    to 0, no drift), λ = κ · mean ‖x‖²."""
    lam = kappa * float((x * x).sum(1).mean())
    dual = torch.linalg.solve(x @ x.T + lam * torch.eye(len(x), dtype=x.dtype), y - x)
    return torch.eye(x.shape[1], dtype=x.dtype) + x.T @ dual


def move(weights: list[dict], statistics: list[dict], t_phi: torch.Tensor | None, t_x: torch.Tensor, b_x: torch.Tensor):
    """Every stored sum and moment of the stages so far, moved by φ → φT (``t_phi`` None: the sums are
    left, to be replaced) and x → xT_x + b_x, in place."""
    for stats in statistics:
        if t_phi is not None:
            for name in ("q_fit", "q_val"):
                stats[name] = (t_phi.T @ stats[name].double()).float()
            for name in ("gram_fit", "gram_val"):
                if name in stats:
                    stats[name] = pack(t_phi.T @ unpack(stats[name], t_phi.shape[0]) @ t_phi)
        if COV_SCATTER in stats:
            stats[COV_SCATTER] = (t_x.T @ stats[COV_SCATTER].double() @ t_x).float()
    for tensors in weights:
        tensors[COV_MEAN] = (tensors[COV_MEAN].double() @ t_x + b_x).float()
        tensors[COV_COVARIANCE] = (t_x.T @ tensors[COV_COVARIANCE].double() @ t_x).float()
        tensors[COV_SHARED] = (t_x.T @ tensors[COV_SHARED].double() @ t_x).float()


class StoredGaussian:
    """One class's Gaussian for ``gaussian_sums`` (carry.py's ``gauss`` and ``stored``): the package's
    ``ClassGaussians`` (drlcli/heads/ridge/carry.py: mean, ``rank`` leading directions, the spread σ
    of the rest) holding that class alone. ``moved``: by a stage's ``TokenMaps``; ``exact`` moves
    the isotropic rest too (by the product of the maps' linear parts), else it stays isotropic."""

    def __init__(self, group: ClassGaussians):
        self.group = group

    def __len__(self) -> int:
        return int(self.group.counts[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self), *self.group.tokens)

    @classmethod
    def of(cls, rows: torch.Tensor, rank: int) -> StoredGaussian:
        return cls(ClassGaussians.of([rows], rank))

    def moved(self, maps: TokenMaps, exact: bool) -> StoredGaussian:
        return StoredGaussian(self.group.moved(maps, exact))

    def draw(self, number: int, generator: torch.Generator) -> torch.Tensor:
        return self.group.draw(0, number, generator)


def gaussian_sums(
    data,
    stages,
    config,
    first_after: int,
    moved: dict,
    projection,
    grid: int,
    draws: str,
    seed: int,
    rank: int,
    phi_too: bool = True,
):
    """Each stage's (q_fit, q_val) before ``first_after``, the (G_fit, G_val) of all of them, each
    stage's class moments of x = f_0/‖f_0‖ (means, covariances) and their summed scatter, from
    the class Gaussians of the ``moved`` rows (class -> (n, S, d)) as the module docstring says
    (``phi_too`` False: the moments alone, the sums None)."""
    width, cells = projection.shape[0], grid**2
    size = projection.shape[1]
    generator = torch.Generator().manual_seed(seed)
    grams = [torch.zeros(size, size, dtype=STAT_DTYPE) for _ in range(2)]
    qs, moments = [], []
    scatter = 0.0
    for s in range(1, first_after):
        names = sorted(stages[s - 1])
        labels = torch.tensor([i for i, c in enumerate(names) for _ in data.train[c]])
        val = validation_mask(labels, fraction=config.ranpac.val_fraction, seed=config.train.seed + s)
        q = [torch.zeros(size, len(names), dtype=STAT_DTYPE) for _ in range(2)]
        width_x = next(iter(moved.values())).shape[-1]
        means = torch.zeros(len(names), width_x, dtype=STAT_DTYPE)
        covariances = torch.zeros(len(names), width_x, width_x, dtype=STAT_DTYPE)
        for i, c in enumerate(names):
            rows = moved[c]  # (n, S, d), or a class Gaussian already (``StoredGaussian``)
            counts = [float((~val[labels == i]).sum()), float(val[labels == i].sum())]
            if draws != "rows" and phi_too:  # the package's own sums (drlcli/heads/ridge/carry.py)
                gaussian = rows if isinstance(rows, StoredGaussian) else StoredGaussian.of(rows, rank)
                sums = expected_sums(
                    gaussian.group,
                    torch.tensor([counts]),
                    projection=projection,
                    layout_cells=cells,
                    draws=int(draws),
                    generator=generator,
                )
                means[i], covariances[i] = sums.x_means[0], sums.x_covariances[0]
                scatter += sums.scatter
                stats = sums.statistics
                q[0][:, i], q[1][:, i] = stats.q_fit[:, 0], stats.q_val[:, 0]
                grams[0] += stats.gram_fit
                grams[1] += stats.gram_val
                continue
            if draws == "rows":
                samples = rows
            else:
                gaussian = rows if isinstance(rows, StoredGaussian) else StoredGaussian.of(rows, rank)
                samples = gaussian.draw(int(draws) * len(rows), generator)
            x = covariance_input(samples)
            means[i], covariances[i] = x.mean(0), torch.cov(x.T)
            scatter += (len(rows) - 1) * covariances[i]
            if not phi_too:
                continue
            if draws == "rows":  # each image in its own part, as fit_stage sums them
                masks = [~val[labels == i], val[labels == i]]
                for part, mask in enumerate(masks):
                    phi = expand(head_input(samples[mask], width, cells), projection)
                    q[part][:, i] = phi.sum(0)
                    grams[part] += phi.T @ phi
                continue
            phi = expand(head_input(samples, width, cells), projection)
            first, second = phi.mean(0), phi.T @ phi / len(phi)
            for part, n in enumerate(counts):
                q[part][:, i] = n * first
                grams[part] += n * second
        qs.append(q)
        moments.append((means, covariances))
    return (qs, grams, moments, scatter) if phi_too else (None, None, moments, scatter)


def run(data, stages, before, after, config, first_after: int, maps, gaussian=None) -> dict:
    """B0 Inc10 through ``replay.stage_scores``; before stage ``first_after`` the stored statistics are
    moved by ``maps()`` ((T or None, T_x, b_x), or None: left stale), and with ``gaussian``
    (projection, grid -> ``gaussian_sums``) G, Q and the class moments replaced by its. A_T capped
    and full after the last stage."""

    def carry(k: int, weights: list[dict], statistics: list[dict], head) -> None:
        if k != first_after or maps is None:
            return
        projection = weights[0][PROJECTION].double()
        move(weights, statistics, *maps(projection, head.layout_grid))
        if gaussian is None:
            return
        qs, grams, moments, scatter = gaussian(projection, head.layout_grid)
        for stats, tensors, (means, covariances) in zip(statistics, weights, moments or []):
            tensors[COV_MEAN], tensors[COV_COVARIANCE] = means.float(), covariances.float()
            stats[COV_SCATTER] = scatter.float()
        for stats, q in zip(statistics, qs or []):
            stats["q_fit"], stats["q_val"] = q[0].float(), q[1].float()
            stats["gram_fit"], stats["gram_val"] = pack(grams[0]), pack(grams[1])

    lookups = [before if k < first_after else after for k in range(1, len(stages) + 1)]
    *_, (last, stage_of, scored) = stage_scores(
        data, stages, lookups, config, [RANK], before_stage=carry, scored={len(stages)}
    )
    return {
        kind: accuracy_report(scores.argmax(1), labels, stage_of, num_stages=last).top1
        for (_, kind), (scores, labels) in scored.items()
    }


def moved_rows(data, stages, before: dict, xb: torch.Tensor, xa: torch.Tensor, lam: float) -> dict:
    """class -> its rows (n, S, d) before the adaptation, moved by ``drift.py``'s per-token ridge map
    fitted from ``xb`` to ``xa`` (a run has no rows: it would move their Gaussian's moments)."""
    names = [c for classes in stages for c in classes]
    rows = [torch.stack([before[str(p)] for p in data.train[c]]).double() for c in names]
    return dict(zip(names, move_tokens(torch.cat(rows), xb, xa, lam).split([len(r) for r in rows])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--before", required=True, help="features before the adaptation (path -> (5, d))")
    parser.add_argument("--after", required=True, help="features after it")
    parser.add_argument("--seed", type=int, default=1993)
    parser.add_argument("--fit-stages", default="10,11", help="the stages whose images estimate the maps (1-based)")
    parser.add_argument("--kappas", default="none,0.01,0.1,1", help="the φ map's ridge, times mean ‖φ‖² (none: stale)")
    parser.add_argument("--x-kappa", type=float, default=0.1, help="the class moments' map's ridge, times mean ‖x‖²")
    parser.add_argument("--carry", choices=("gram", "gaussian"), default="gram")
    parser.add_argument(
        "--moments",
        choices=("map", "gaussian"),
        help="the class moments of x moved by T_x or drawn (default: map with --carry gram, gaussian with gaussian)",
    )
    parser.add_argument("--draws", default="rows,1,5,20", help="gaussian: k draws per image (rows: the moved rows)")
    parser.add_argument("--gauss-rank", type=int, default=0, help="gaussian: covariance rank kept (0: all)")
    parser.add_argument("--row-lam", type=float, default=100.0, help="gaussian: the rows' per-token ridge map λ")
    args = parser.parse_args()
    args.moments = args.moments or ("map" if args.carry == "gram" else "gaussian")
    load = lambda f: dict(zip(*[torch.load(f)[k] for k in ("paths", "features")]))  # noqa: E731
    before, after = load(args.before), load(args.after)
    data, stages = plan([args.data], args.seed, "val")
    fit_stages = [int(s) for s in args.fit_stages.split(",")]
    fit = [str(p) for s in fit_stages for c in stages[s - 1] for p in data.train[c]]
    old = [str(p) for s in range(1, min(fit_stages)) for c in stages[s - 1] for p in data.train[c]]
    xb, xa = (torch.stack([f[p] for p in fit]).double() for f in (before, after))
    ob, oa = (torch.stack([f[p] for p in old]).double() for f in (before, after))
    config = RunConfig.for_method("drl", {"ranpac": {"covariance_rank": 0}}, preset="frozen").with_train(seed=args.seed)
    print(f"maps fitted on {len(fit)} images of stages {args.fit_stages}; moved: stages 1-{min(fit_stages) - 1}")

    def maps_for(kappa: float | None):
        def maps(projection: torch.Tensor, grid: int):
            width, cells = projection.shape[0], grid**2
            phi = lambda f: expand(head_input(f, width, cells), projection)  # noqa: E731
            cb, ca = covariance_input(xb).double(), covariance_input(xa).double()
            scale = float((cb * cb).sum(1).mean())
            b_mat, b_x = ridge_map(cb, ca, args.x_kappa * scale)
            t_x = torch.eye(cb.shape[1], dtype=cb.dtype) + b_mat
            if kappa is None:  # G and Q are replaced (--carry gaussian)
                return None, t_x, b_x
            t_phi = phi_map(phi(xb), phi(xa), kappa)
            # how far the map brings the old images' φ (which the run never sees) towards their φ after
            pb, pa = phi(ob), phi(oa)
            err = ((pb @ t_phi - pa).norm() / (pb - pa).norm()).item()
            print(f"  κ {kappa:g}: old images' φ error {err:.3f} of the stale one's", flush=True)
            return t_phi, t_x, b_x

        return maps

    moved = {}
    if args.carry == "gaussian" or args.moments == "gaussian":
        moved = moved_rows(data, stages[: min(fit_stages) - 1], before, xb, xa, args.row_lam)
    if args.carry == "gaussian":
        for draws in args.draws.split(","):
            tick = time.perf_counter()

            def gaussian(projection, grid, k=draws):
                qs, grams, moments, scatter = gaussian_sums(
                    data, stages, config, min(fit_stages), moved, projection, grid, k, args.seed, args.gauss_rank
                )  # --moments map: the class moments moved by T_x as the Gram map moves them, not drawn
                return qs, grams, (moments if args.moments != "map" else None), scatter

            result = run(data, stages, before, after, config, min(fit_stages), maps_for(None), gaussian)
            print(
                f"{Path(args.after).name} seed {args.seed} gaussian rank {args.gauss_rank} draws {draws} "
                f"moments {args.moments}: A_T capped "
                f"{result['capped']:.2f} full {result['full']:.2f} ({time.perf_counter() - tick:.0f} s)",
                flush=True,
            )
        return
    moments = None
    if args.moments == "gaussian":  # the class moments of x from 20 draws a row of each moved class Gaussian
        moments = lambda projection, grid: gaussian_sums(  # noqa: E731
            data, stages, config, min(fit_stages), moved, projection, grid, "20", args.seed, 0, phi_too=False
        )
    for kappa in args.kappas.split(","):
        tick = time.perf_counter()
        maps = None if kappa == "none" else maps_for(float(kappa))
        result = run(data, stages, before, after, config, min(fit_stages), maps, moments if maps else None)
        print(
            f"{Path(args.after).name} seed {args.seed} κ {kappa} moments {args.moments}: A_T capped {result['capped']:.2f} "
            f"full {result['full']:.2f} ({time.perf_counter() - tick:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
