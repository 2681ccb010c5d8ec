// Reduce buckets: slots, growth and double buffering.
#include <deepcompile/reduce_bucket.h>

#include "fixtures.h"

#include <gtest/gtest.h>

using namespace deepcompile;
using namespace dctest;

TEST(ReduceBucket, SlotsFlushAndGrow) {
  ReduceBucket bucket(8, at::kFloat, cpuAlloc);
  EXPECT_FALSE(bucket.allocated());  // lazily allocated
  EXPECT_FALSE(bucket.shouldFlush(100));  // an empty bucket never needs a flush
  at::Tensor a = bucket.allocate(5);
  EXPECT_EQ(a.numel(), 5);
  EXPECT_TRUE(bucket.shouldFlush(4));
  EXPECT_FALSE(bucket.shouldFlush(3));
  EXPECT_THROW(bucket.allocate(4), c10::Error);
  EXPECT_THROW(bucket.reserve(20), c10::Error);  // cannot grow with pending slots
  bucket.reset();
  bucket.reserve(20);
  EXPECT_EQ(bucket.capacity(), 20);
  EXPECT_EQ(bucket.allocate(20).numel(), 20);
}

TEST(ReduceBucket, DoubleBufferAlternatesAndClears) {
  DoubleBufferedReduceBucket buckets(4, /*double_buffer=*/true, cpuAlloc);
  ReduceBucket* first = &buckets.current(at::kFloat);
  first->allocate(2);
  buckets.swap(at::kFloat, readyCompletion());
  ReduceBucket* second = &buckets.current(at::kFloat);
  EXPECT_NE(first, second);
  EXPECT_EQ(first->offset(), 0);
  EXPECT_TRUE(first->last_use != nullptr);
  second->allocate(1);
  buckets.current(at::kBFloat16).allocate(1);
  EXPECT_EQ(buckets.allocatedNumel(), 12);  // two float buffers + one bf16 buffer of 4
  buckets.swap(at::kFloat, readyCompletion());
  EXPECT_EQ(&buckets.current(at::kFloat), first);
  buckets.clear();
  EXPECT_EQ(buckets.allocatedNumel(), 0);
}

TEST(ReduceBucket, SingleBufferKeepsSameBucket) {
  DoubleBufferedReduceBucket buckets(4, /*double_buffer=*/false, cpuAlloc);
  ReduceBucket* first = &buckets.current(at::kFloat);
  buckets.swap(at::kFloat, readyCompletion());
  EXPECT_EQ(&buckets.current(at::kFloat), first);
}
