#include <gtest/gtest.h>

#include "zellige/workload.h"

TEST(Smoke, HeadersCompile) { EXPECT_EQ(zellige::LatentGeometry{}.temporal_stride, 4); }
