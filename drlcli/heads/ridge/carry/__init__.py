"""How the ridge head keeps its sums true while a carried network moves (the default's schedule,
``Schedule.carries``): each earlier class kept as a Gaussian of the head's tokens and moved by ridge
maps fitted on the stage's own images, and the head's sums rebuilt from it.

- ``gaussians.py``: the class Gaussians and the token maps that move them (pure tensor maths).
- ``sums.py``: the sums (Q, the Grams, the scatter) the earlier classes' images would give, from the
  Gaussians (drawn, or E[φ] in closed form).
- ``stage.py``: one carried stage's fit put together (``fit.py`` calls it), and its checks.

Imports no torch here: the modules load when a carried stage is fitted.
"""
