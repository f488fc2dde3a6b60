"""ridge + w z(FeCAM-style class covariances) [+ v z(own-stage cosine)] on DRL's trained subspaces:
the 6-stage validation study's features (cal_T6_trval.npz, sk_T6_trval.npz from extract.py, see
docs/research/drl-subspaces.md), run in the folder that holds them:

    python cov_own.py
"""
import numpy as np
import torch
import torch.nn.functional as F
from sim import Sim, load, own_cos, ranpac_scores, run_head


def z(S):
    S = S - S.mean(1, keepdim=True)
    return S / S.pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-12)

def fecam(sim, t, m, C_t, a=0.3, b=0.8):
    D = sim.D
    x = F.normalize(D["tr_x"][:, 0], dim=-1)
    y = D["tr_y"]
    st = D["cs"][y]
    msk = st <= t
    x, y = x[msk], y[msk]
    d = x.shape[1]
    mus, covs, scat = [], [], 0
    for c in range(C_t):
        xc = x[y == c]
        mu = xc.mean(0)
        dc = xc - mu
        mus.append(mu)
        covs.append(dc.T @ dc / max(len(xc) - 1, 1))
        scat = scat + dc.T @ dc
    Sp = scat / (len(y) - C_t)
    q = F.normalize(D["ev_x"][m, 0], dim=-1)
    out = torch.zeros(len(q), C_t)
    for c in range(C_t):
        S = (1 - b) * covs[c] + b * Sp
        S = (1 - a) * S + a * torch.trace(S) / d * torch.eye(d)
        P = torch.linalg.inv(S)
        dd = q - mus[c]
        out[:, c] = -((dd @ P) * dd).sum(1)
    return out

if __name__ == "__main__":
  for data in ("cal", "sk"):
      D = load(f"{data}_T6_trval.npz", "val_bench", 6)
      sim = Sim(D)
      for v in (0.0, 0.3, 0.6, 1.0):
          def fn(sim, t, m, C_t, v=v):
              s = z(ranpac_scores(sim, t, m, C_t, 1e5)) + 4 * z(fecam(sim, t, m, C_t))
              return s + v * z(own_cos(sim, t, m, C_t)) if v else s
          accs = run_head(sim, fn)
          print(data, f"v={v}", f"Abar {np.mean(accs):.2f} A6 {accs[-1]:.2f}", [round(a, 1) for a in accs], flush=True)
      accs = run_head(sim, lambda sim, t, m, C_t: ranpac_scores(sim, t, m, C_t, 1e5))
      print(data, "ridge alone", f"Abar {np.mean(accs):.2f} A6 {accs[-1]:.2f}", flush=True)
