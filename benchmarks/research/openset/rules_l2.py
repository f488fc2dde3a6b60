"""rules.py on l2-normalised f_0 (the class-covariance head's features): calibration of the relative
Mahalanobis rule there (issue 19). Same arguments as rules.py."""
import rules
from ptmheads import l2n

_load = rules.load_feats


def load_l2(name):
    feats = _load(name)
    feats["parts"] = {k: (l2n(v[0]),) + tuple(v[1:]) for k, v in feats["parts"].items()}
    return feats


rules.load_feats = load_l2
if __name__ == "__main__":
    rules.main()
