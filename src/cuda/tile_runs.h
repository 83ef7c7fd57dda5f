// Internal: the order in which the sm90 run scheduler (sm90_run_scheduler.cuh) hands a grouped
// GEMM's output tiles to its persistent clusters. Plain functions of host and device, so that the
// CPU tests pin the order down.
//
// CUTLASS's group scheduler deals the tiles of all groups out one at a time: cluster q takes
// tiles q, q + Q, q + 2Q, ... of the sequence. Where a group has fewer tiles than there are
// clusters (qwen3-30b-a3b at 4096 tokens: 12-48 tiles a group, 66-132 clusters), every tile a
// cluster takes is in a group other than its last one's, and each such switch costs the cluster
// a rewrite of its TMA descriptors and a reload of the group's shape on the path of the next tile.
// The run order deals runs of R consecutive tiles instead: run j (tiles jR .. jR + R - 1) goes to
// cluster j mod Q, so a cluster switches groups at most once in R tiles where groups are long
// enough, while the Q clusters together still work through one window of about Q x R tiles at a
// time (the groups of that window keep their operands in L2).
//
// The sequence ("units", one a cluster's tile): the groups in order, and within a group its
// cluster tiles along M first, so the tiles next to each other share their column of B.
#pragma once

#include <cstdint>

#include "cuda/plan_math.h"

namespace moekit::detail::cuda {

struct TileRuns {
  uint64_t clusters;  // Q >= 1: the persistent clusters the grid holds
  uint64_t run;       // R >= 1: consecutive units a cluster takes before the next cluster's run

  // The unit that cluster q takes at its step s (s = 0, 1, ...). Strictly increasing in s for
  // a given q, and a bijection from {(q, s)} onto the units.
  MOEKIT_HOST_DEVICE uint64_t unit(uint64_t q, uint64_t step) const {
    return (step / run) * clusters * run + q * run + step % run;
  }
};

// A group's tiles along one dimension, counted in clusters: ceil(extent / tile) rounded up to a
// multiple of the cluster's extent there (a cluster's CTAs take neighbouring tiles; one past the
// group's edge computes nothing the TMA stores keep), divided by that extent. 0 for extent <= 0.
MOEKIT_HOST_DEVICE inline uint64_t cluster_tiles(int64_t extent, int64_t tile, int64_t cluster) {
  if (extent <= 0) return 0;
  const uint64_t tiles = static_cast<uint64_t>((extent + tile - 1) / tile);
  return (tiles + cluster - 1) / cluster;
}

// Unit t of a group with `along_m` cluster tiles along M: its cluster tile (m, n).
struct ClusterTile {
  uint64_t m, n;
};
MOEKIT_HOST_DEVICE inline ClusterTile cluster_tile_of(uint64_t t, uint64_t along_m) {
  return ClusterTile{t % along_m, t / along_m};
}

// The run length for a call expected to hold `units` cluster tiles over `clusters` clusters: as
// long as 8 (a cluster then switches groups at most once in 8 tiles), but short enough that each
// cluster gets 4 runs or more, since a cluster takes at most one run more than another (the last
// round's imbalance is a run, so at most about a quarter of one cluster's share). 1 (CUTLASS's
// order) for fewer than 8 units a cluster.
inline uint64_t run_length(uint64_t units, uint64_t clusters) {
  if (clusters == 0) return 1;
  const uint64_t r = units / (4 * clusters);
  return r < 1 ? 1 : (r > 8 ? 8 : r);
}

// The cluster tiles a grouped GEMM is expected to hold, from what the host knows: `groups` local
// groups whose M extents add up to m_total (row-grouped: the rows are ragged, and a group's last
// tile is taken as half full on average) or are each m_each (contraction-grouped: every non-empty
// group's output has the same rows; m_each > 0), all of width n.
inline uint64_t expected_units(int64_t m_total, int64_t m_each, int64_t groups, int64_t n,
                               int64_t tile_m, int64_t tile_n, int64_t cluster_m,
                               int64_t cluster_n) {
  if (groups <= 0) return 0;
  const uint64_t along_n = cluster_tiles(n, tile_n, cluster_n);
  const uint64_t cluster_rows = static_cast<uint64_t>(tile_m * cluster_m);
  const uint64_t along_m =
      m_each > 0
          ? static_cast<uint64_t>(groups) * cluster_tiles(m_each, tile_m, cluster_m)
          : (static_cast<uint64_t>(m_total < 0 ? 0 : m_total) + cluster_rows - 1) / cluster_rows +
                static_cast<uint64_t>(groups) / 2;
  return along_m * along_n;
}

}  // namespace moekit::detail::cuda
