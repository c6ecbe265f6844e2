"""Stage 4: measured acceptance + a node profile -> the depth to serve, the TTT depth worth
training and the drafter kind (chain, parallel, block) to serve (pure). profiles.py (node
profiles; profiles/ holds the packaged ones, serve/profile.py measures one), acceptance.py
(acceptance sources), cost.py (the cost model, plan, the choice of kind) and output.py (words,
tables, plots, files); planner.py re-exports them for the modules that import the planner as
one. The serving stage uses the cost model for dynamic depth, so plan sits below serve.
"""
