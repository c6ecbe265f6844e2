"""Stage 4: measured acceptance + a node profile -> the depth to serve and the TTT depth worth
training (planner, pure). profiles/ holds the packaged node profiles; serve/profile.py measures
one. The serving stage uses the cost model for dynamic depth, so plan sits below serve.
"""
