// Top-p's cut over a row's kept set so far (top_p_cut.cpp), for kept_set.cpp's row_threshold.
#pragma once
#include <cstdint>

#include "../gspo_math.h"
#include "kept_row_scratch.h"
#include "kept_set.h"

namespace gspo::cpu {

struct TopPQuery {
  double top_p;
  float z_max;      // the row's largest z, always kept
  float lower;      // the kept set so far: {x >= lower}
  bool z_in_e;      // the scratch's e holds z already (min-p mapped the row)
  bool with_stats;  // the kept set's softmax stats too, where the cut is settled on the masses' bracket
};

// The row settled (`settled`: `row` is its KeptRow), or the bound its kept set rises to (`lower`).
struct TopPCut {
  bool settled;
  KeptRow row;
  float lower;
};

// w.x holds the row in float32 (w.e its z when q.z_in_e); w.e and the rest are overwritten.
TopPCut top_p_cut(RowScratch& w, int64_t vocab, const LogitMap& map, const TopPQuery& q);

}  // namespace gspo::cpu
