"""Tile order, persistent grid sizing and the SM partition between roles."""
from .tiles import (GridPlan, arrival_order, cdiv, gather_order, grouped_order, plan_grid,
                    tile_coords_host)

__all__ = ["GridPlan", "cdiv", "plan_grid", "grouped_order", "tile_coords_host",
           "arrival_order", "gather_order"]
