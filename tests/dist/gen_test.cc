// gen_test.cc — random programs with collectives (tests/ir_gen's
// IR_GEN_COLLECTIVE) across the world's processes: every rank builds the
// same program from a shared seed and runs it on arguments of its own (the
// seed and its rank), interpreted as written and compiled by the CPU backend
// after the default pipeline (the combiner merges independent all_reduces;
// the plan overlaps collectives with kernels, KILN_DIST_OVERLAP=1, and
// not). The two must agree on every rank (1e-5; results that may jump by
// the interpreter's and the compiled code's own roundings, tests/may_jump.h,
// are not compared), and every rank must reach every collective in the same
// order, or the header exchange fails the call. ctest runs it in a world of one (dist.one_process)
// and under mpirun -np 2, 3 and 4.
#include <cstdlib>
#include <string>

#include "../ir_gen.h"
#include "../may_jump.h"
#include "../test_util.h"
#include "cpu/cpu.h"
#include "ir.h"
#include "passes.h"

using namespace kiln_test;

namespace {

int count_ops(const ir_func *f, op_id op) {
  int n = 0;
  for (int i = 0; i < f->n_instrs; i++) n += f->instrs[i].op == op;
  return n;
}

bool is_collective(op_id op) {
  return op == OP_ALL_REDUCE || op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER || op == OP_BROADCAST_FROM;
}

TEST(DistRandom, ProgramsWithCollectivesCompiledEqualInterpretedOnEveryRank) {
  Scoped scope;
  int world = kiln_dist_size(), rank = kiln_dist_rank();
  ASSERT_GE(world, 1) << kiln_last_error();
  ir_gen_options o = ir_gen_default_options();
  o.kinds |= IR_GEN_COLLECTIVE;
  o.world = world;
  o.min_instrs = 10, o.max_instrs = 40;
  cpu_options strict{};
  strict.no_contract = true;
  int n = std::max(20, program_count() / 5), with = 0, merged = 0, kinds[4] = {0, 0, 0, 0};
  for (uint64_t seed = first_seed(); seed < first_seed() + (uint64_t)n; seed++) {
    ir_module *m = ir_gen_program(seed, &o);
    ASSERT_NE(m, nullptr) << "seed " << seed << ": " << kiln_last_error();
    ir_func *f = ir_module_find(m, "gen");
    ASSERT_NE(f, nullptr);
    char *text = ir_print_module(m);
    std::string where = "seed " + std::to_string(seed) + ", rank " + std::to_string(rank) + "\n" + text;
    free(text);
    int collectives = 0;
    for (int i = 0; i < f->n_instrs; i++) collectives += is_collective(f->instrs[i].op);
    const op_id ops[4] = {OP_ALL_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_BROADCAST_FROM};
    for (int k = 0; k < 4; k++) kinds[k] += count_ops(f, ops[k]) > 0;
    with += collectives > 0;
    int reduces = count_ops(f, OP_ALL_REDUCE);
    std::vector<bool> jumps = may_jump(f, false);
    std::vector<bool> unchecked((size_t)f->n_results);
    for (int r = 0; r < f->n_results; r++) unchecked[(size_t)r] = jumps[(size_t)f->results[r]];
    kiln_scope_push();
    std::vector<kiln_tensor *> args((size_t)f->n_params), want((size_t)f->n_results), got((size_t)f->n_results);
    ASSERT_EQ(ir_gen_args(f, seed * 1000003u + (uint64_t)rank, args.data()), 0) << kiln_last_error();
    ASSERT_EQ(ir_interpret(f, args.data(), want.data()), 0) << where << kiln_last_error();
    ASSERT_EQ(pass_run_pipeline(f, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << where << kiln_last_error();
    merged += count_ops(f, OP_ALL_REDUCE) < reduces;
    // the passes keep every collective but those the combiner merges
    int after = 0;
    for (int i = 0; i < f->n_instrs; i++) after += is_collective(f->instrs[i].op);
    EXPECT_EQ(after, collectives - (reduces - count_ops(f, OP_ALL_REDUCE))) << where;
    cpu_program *c = cpu_compile_with(f, &strict);
    ASSERT_NE(c, nullptr) << where << kiln_last_error();
    for (const char *overlap : {"1", "0"}) {  // collectives on the communication thread, and not
      EnvGuard e("KILN_DIST_OVERLAP", overlap);
      ASSERT_EQ(cpu_run(c, args.data(), got.data()), 0) << where << kiln_last_error();
      for (int r = 0; r < f->n_results; r++) {
        if (unchecked[(size_t)r]) continue;
        EXPECT_TRUE(allclose(got[(size_t)r], want[(size_t)r], 1e-5, 1e-5))
            << "result " << r << ", KILN_DIST_OVERLAP=" << overlap << ", " << where;
      }
    }
    cpu_program_free(c);
    kiln_scope_pop();
    ir_module_free(m);
    if (HasFailure()) break;
  }
  if (rank == 0)
    std::printf("  %d programs in a world of %d: %d with collectives (all_reduce %d, all_gather %d, "
                "reduce_scatter %d, broadcast_from %d), %d with all_reduces merged\n",
                n, world, with, kinds[0], kinds[1], kinds[2], kinds[3], merged);
  EXPECT_GT(with, n / 2);
  for (int k = 0; k < 4; k++) EXPECT_GT(kinds[k], 0) << "programs with collective kind " << k;
  EXPECT_GT(merged, 0) << "programs whose all_reduces the combiner merged";
}

}  // namespace
