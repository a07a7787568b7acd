// nccl.cpp — runs the real kernels/cuda/nccl_comm.cu (the collectives of CUDA tensors) on the CPU under the emulator
// (emu.h), in an mpirun job, with NCCL stood in for by MPI (fake/nccl.h), through the CUDA table's entries
// (tide_cuda_dist_entries). Checked against the CPU's MPI path of engine/dist/comm.c (libtide) on the same values:
// - the chain all-reduce, f32 and f64, over the world and over process groups (contiguous {0,1},{2,3} and
//   interleaved {0,2},{1,3} at 4 ranks), lengths 1 .. several chunks (the harness builds NCCL_CHUNK = 257): every
//   rank holds bitwise the CPU path's sum, which is bitwise the serial fold ((x_0 + x_1) + x_2) + ... in group
//   order; the bytes each rank sends are the chain's (its buffer once or twice);
// - all-gather, all-to-all-v (uneven counts, zeros, a rank sending itself rows), broadcast (root 0 and the last
//   rank) and send / recv over the world and over the groups: the CPU path's bytes;
// - one NCCL communicator a group, made on the group's first collective and reused after it;
// - errors: a group id past the table, no MPI communicator to bootstrap over.
// Usage: tests/gpu/emu/run_nccl.sh (builds it, then runs it under mpirun at 2 and 4 ranks).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <cstring>
#include <string>
#include <random>

#include "emu_host.h"
#include "tide.h"

// the side stream's runtime calls, recorded: the emulator's stream is synchronous, so what is checked is the routing
// (which stream each collective is queued on) and the order of the event calls
static std::string ev_log;
#define cudaStreamCreateWithFlags(p, f) (*(p) = (cudaStream_t)0x51de, ev_log += "C", cudaSuccess)
#define cudaEventCreateWithFlags(p, f) (*(p) = (cudaEvent_t)(ev_log.size() + 1), cudaSuccess)
#define cudaEventRecord(e, s) (ev_log += ((s) == (cudaStream_t)0x51de ? "r" : "R"), cudaSuccess)
#define cudaStreamWaitEvent(s, e, f) (ev_log += ((s) == (cudaStream_t)0x51de ? "w" : "W"), cudaSuccess)

#include "nccl_comm_emu.inc"

static int n_pass, n_fail, me, world;

static void check_true(const std::string &name, bool ok)
{
    if (me == 0 || !ok) printf("  [rank %d] %-64s %s\n", me, name.c_str(), ok ? "ok" : "FAIL");
    if (ok) n_pass++;
    else n_fail++;
}

// every rank's values for a case, reproducible on any rank: magnitudes over six decades, so the order of the
// additions shows in the bits
static std::vector<double> values_of(int rank, int64_t n, int seed)
{
    std::mt19937_64 g((uint64_t)seed * 1000003u + (uint64_t)rank * 7919u + 17u);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::uniform_real_distribution<double> ud(-3.0, 3.0);
    std::vector<double> v((size_t)n);
    for (auto &x : v) x = nd(g) * std::pow(10.0, ud(g));
    return v;
}

template <class T> static std::vector<T> cast(const std::vector<double> &v)
{
    std::vector<T> o(v.size());
    for (size_t i = 0; i < v.size(); i++) o[i] = (T)v[i];
    return o;
}

struct group {
    tide_dist_grp d;         // as comm.c hands it to the backend
    std::vector<int> members;
    MPI_Comm comm;
    int engine_id;           // the engine's group of the same color (its CPU path is the reference)
};

// the engine's group for a color and this harness's descriptor of it: the same members, an MPI communicator of
// their own, and the engine's id, so the backend keeps one NCCL communicator per engine group
static group split(int color)
{
    group G;
    G.engine_id = tide_dist_group_split(color);
    MPI_Comm_split(MPI_COMM_WORLD, color, me, &G.comm);
    int r, n;
    MPI_Comm_rank(G.comm, &r);
    MPI_Comm_size(G.comm, &n);
    G.members.resize((size_t)n);
    MPI_Allgather(&me, 1, MPI_INT, G.members.data(), 1, MPI_INT, G.comm);
    G.d = {G.engine_id, r, n, G.members.data(), &G.comm};
    return G;
}

static group world_group()
{
    group G;
    G.engine_id = 0;
    G.comm = MPI_COMM_WORLD;
    G.d = {0, me, world, NULL, &G.comm};
    return G;
}

static tide_backend T;   // the CUDA table's collectives

template <class E> static bool bits_equal(const std::vector<E> &a, const std::vector<E> &b)
{
    return a.size() == b.size() && (a.empty() || memcmp(a.data(), b.data(), a.size() * sizeof(E)) == 0);
}

template <class E> static void allreduce_case(group &G, const char *gname, int64_t n, int seed)
{
    const int dt = std::is_same<E, float>::value ? TIDE_F32 : TIDE_F64;
    const char *dn = dt == TIDE_F32 ? "f32" : "f64";
    std::vector<E> dev = cast<E>(values_of(me, n, seed));
    // the CPU path of comm.c on the same values
    std::vector<double> mine = values_of(me, n, seed);
    int64_t shape[1] = {n};
    tide_tensor *t = tide_from_f64(dt, 1, shape, 0, mine.data());
    int rc_cpu = tide_dist_allreduce_sum_group_(G.engine_id, t);
    std::vector<E> cpu((size_t)n);
    rc_cpu |= tide_read_bytes(t, cpu.data(), (size_t)n * sizeof(E));
    tide_tensor_release(t);
    // the serial fold in group order
    std::vector<E> fold = cast<E>(values_of(G.members.empty() ? 0 : G.members[0], n, seed));
    for (int r = 1; r < G.d.size; r++) {
        std::vector<E> x = cast<E>(values_of(G.members.empty() ? r : G.members[(size_t)r], n, seed));
        for (int64_t i = 0; i < n; i++) fold[(size_t)i] = fold[(size_t)i] + x[(size_t)i];
    }
    long long b0 = fake_nccl::bytes_sent;
    int rc = T.dist_allreduce_sum(&G.d, dt, dev.data(), n, NULL);
    long long sent = fake_nccl::bytes_sent - b0;
    long long want = (long long)n * (long long)sizeof(E) * ((G.d.rank < G.d.size - 1) + (G.d.rank != G.d.size - 2));
    if (G.d.size == 1) want = 0;
    char name[160];
    snprintf(name, sizeof name, "allreduce %s %s n=%lld: == the CPU chain == the serial fold", gname, dn, (long long)n);
    check_true(name, rc == 0 && rc_cpu == 0 && bits_equal(dev, cpu) && bits_equal(dev, fold));
    snprintf(name, sizeof name, "allreduce %s %s n=%lld: bytes sent %lld (the chain's %lld)", gname, dn, (long long)n,
             sent, want);
    check_true(name, sent == want);
}

static void allgather_case(group &G, const char *gname, int64_t nbytes)
{
    std::vector<unsigned char> in((size_t)nbytes), out((size_t)nbytes * (size_t)G.d.size, 0xAB);
    for (int64_t i = 0; i < nbytes; i++) in[(size_t)i] = (unsigned char)(me * 37 + i * 11 + 5);
    int rc = T.dist_allgather(&G.d, in.data(), out.data(), nbytes);
    int64_t si[1] = {nbytes}, so[1] = {nbytes * G.d.size};
    tide_tensor *ti = tide_from_bytes(TIDE_U8, 1, si, 0, in.data(), (size_t)nbytes);
    tide_tensor *to = tide_empty(TIDE_U8, 1, so, 0);
    int rc_cpu = tide_dist_allgather_group_(G.engine_id, to, ti);
    std::vector<unsigned char> cpu(out.size());
    rc_cpu |= tide_read_bytes(to, cpu.data(), cpu.size());
    bool same = rc == 0 && rc_cpu == 0 && out == cpu;
    tide_tensor_release(ti);
    tide_tensor_release(to);
    check_true(std::string("allgather ") + gname + " " + std::to_string(nbytes) + " bytes a rank: == the CPU path", same);
}

// rank r sends (r + q + 1) % 3 rows of 3 floats to group rank q (zeros included), itself too
static void alltoallv_case(group &G, const char *gname)
{
    int w = G.d.size, r = G.d.rank;
    std::vector<int64_t> sc((size_t)w), rcn((size_t)w), sb((size_t)w), so((size_t)w), rb((size_t)w), ro((size_t)w);
    int64_t ns = 0, nr = 0;
    for (int q = 0; q < w; q++) {
        sc[(size_t)q] = (int64_t)((r + q + 1) % 3) * 3;
        rcn[(size_t)q] = (int64_t)((q + r + 1) % 3) * 3;
        so[(size_t)q] = ns * 4; sb[(size_t)q] = sc[(size_t)q] * 4; ns += sc[(size_t)q];
        ro[(size_t)q] = nr * 4; rb[(size_t)q] = rcn[(size_t)q] * 4; nr += rcn[(size_t)q];
    }
    std::vector<float> send((size_t)ns), recv((size_t)nr, -1.0f);
    for (int64_t i = 0; i < ns; i++) send[(size_t)i] = (float)(1000 * me + i) + 0.25f;
    int rc = T.dist_alltoallv(&G.d, send.data(), sb.data(), so.data(), recv.data(), rb.data(), ro.data());
    // the CPU path
    std::vector<double> sd(send.begin(), send.end());
    int64_t s1[1] = {ns}, s2[1] = {nr};
    tide_tensor *ts = tide_from_f64(TIDE_F32, 1, s1, 0, sd.data());
    tide_tensor *tr = tide_empty(TIDE_F32, 1, s2, 0);
    int rc_cpu = tide_dist_alltoallv_group_(G.engine_id, ts, sc.data(), tr, rcn.data());
    std::vector<float> cpu(recv.size());
    rc_cpu |= tide_read_bytes(tr, cpu.data(), cpu.size() * 4);
    bool same = rc == 0 && rc_cpu == 0 && bits_equal(recv, cpu);
    tide_tensor_release(ts);
    tide_tensor_release(tr);
    check_true(std::string("alltoallv ") + gname + ": uneven counts with zeros == the CPU path", same);
}

static void broadcast_case(group &G, const char *gname, int root)
{
    std::vector<double> v(37);
    for (size_t i = 0; i < v.size(); i++) v[i] = G.d.rank == root ? 0.5 * (double)i - 3.0 : -99.0;
    int rc = T.dist_broadcast(&G.d, v.data(), (int64_t)(v.size() * sizeof(double)), root);
    bool ok = rc == 0;
    for (size_t i = 0; i < v.size(); i++) ok = ok && v[i] == 0.5 * (double)i - 3.0;
    check_true(std::string("broadcast ") + gname + " from group rank " + std::to_string(root), ok);
}

// group rank 0 sends to the last and the last answers: point to point in group ranks
static void sendrecv_case(group &G, const char *gname)
{
    int last = G.d.size - 1;
    if (last == 0) return;
    std::vector<int> a(19), b(19, 0);
    for (int i = 0; i < 19; i++) a[(size_t)i] = 100 * G.d.id + i;
    bool ok = true;
    if (G.d.rank == 0) {
        ok = T.dist_send(&G.d, a.data(), 19 * 4, last) == 0 && T.dist_recv(&G.d, b.data(), 19 * 4, last) == 0;
        for (int i = 0; i < 19; i++) ok = ok && b[(size_t)i] == a[(size_t)i] + 1;
    } else if (G.d.rank == last) {
        ok = T.dist_recv(&G.d, b.data(), 19 * 4, 0) == 0;
        for (int i = 0; i < 19; i++) ok = ok && b[(size_t)i] == a[(size_t)i];
        for (int i = 0; i < 19; i++) b[(size_t)i] += 1;
        ok = ok && T.dist_send(&G.d, b.data(), 19 * 4, 0) == 0;
    }
    check_true(std::string("send / recv ") + gname + ": group rank 0 <-> the group's last rank", ok);
}

static void group_cases(group &G, const char *gname)
{
    for (int64_t n : {1, 256, 257, 1000}) allreduce_case<float>(G, gname, n, (int)n + 1);
    for (int64_t n : {3, 777}) allreduce_case<double>(G, gname, n, (int)n + 2);
    allgather_case(G, gname, 13);
    alltoallv_case(G, gname);
    broadcast_case(G, gname, 0);
    broadcast_case(G, gname, G.d.size - 1);
    sendrecv_case(G, gname);
}

int main()
{
    if (tide_dist_init() != 0) { fprintf(stderr, "nccl: tide_dist_init: %s\n", tide_last_error()); return 1; }
    me = tide_dist_rank();
    world = tide_dist_world_size();
    memset(&T, 0, sizeof T);
    tide_cuda_dist_entries(&T);
    if (!T.dist_allreduce_sum || !T.dist_alltoallv || !T.dist_init) {
        printf("nccl: the CUDA table has no collectives (built without TIDE_HAVE_NCCL)\n");
        return 1;
    }
    if (me == 0) printf("nccl_comm.cu under the emulator, NCCL over MPI, %d ranks (chunks of %d elements)\n", world, NCCL_CHUNK);

    group W = world_group();
    int n = 0;
    check_true("dist_init: the world's communicator has MPI's ranks", T.dist_init(&W.d, &n) == 0 && n == world);
    int made = fake_nccl::comms_made;
    group_cases(W, "world");
    check_true("the world's communicator is made once", fake_nccl::comms_made == made);

    if (world >= 2) {
        // dp-like groups (interleaved) and ep-like groups (contiguous), as a dp x ep layout splits the world
        group A = split(me % 2), B = split(me / 2);
        group_cases(A, world >= 4 ? "interleaved {0,2},{1,3}" : "one rank a group");
        group_cases(B, world >= 4 ? "contiguous {0,1},{2,3}" : "the world as a group");
        check_true("one NCCL communicator a group, made at its first collective",
                   fake_nccl::comms_made == made + 2 && g_comms[A.d.id] && g_comms[B.d.id] && g_comms[A.d.id] != g_comms[B.d.id] &&
                       g_comms[A.d.id] != g_comms[0]);
        // the world again after the groups: its own communicator, the same sums
        allreduce_case<float>(W, "world after the groups", 300, 99);
    }

    // the gradient buckets' side stream: fork queues the sums there after the main stream's work, back returns to the
    // main stream, join makes the main stream wait; a sum with the reducer's scratch allocates nothing
    {
        std::vector<double> mine = values_of(me, 600, 5), want = mine;
        int64_t shape[1] = {600};
        tide_tensor *t = tide_from_f64(TIDE_F64, 1, shape, 0, mine.data());
        tide_dist_allreduce_sum_(t);
        tide_read_bytes(t, want.data(), 600 * sizeof(double));
        tide_tensor_release(t);
        std::vector<double> scratch(600, 0.0);
        size_t live = emu::live_bytes;
        ev_log.clear();
        bool ok = T.comm_fork && T.comm_fork() == 0;
        int rc = T.dist_allreduce_sum(&W.d, TIDE_F64, mine.data(), 600, scratch.data());
        cudaStream_t on = fake_nccl::last_stream;
        ok = ok && T.comm_back() == 0;
        int rc2 = T.dist_broadcast(&W.d, scratch.data(), 8, 0);
        cudaStream_t after = fake_nccl::last_stream;
        ok = ok && T.comm_join() == 0;
        check_true("side stream: the sum with the reducer's scratch == the CPU chain, allocating nothing",
                   ok && rc == 0 && bits_equal(mine, want) && emu::live_bytes == live);
        check_true("side stream: its collectives on the side stream, after back on the main one",
                   on == (cudaStream_t)0x51de && rc2 == 0 && after != (cudaStream_t)0x51de);
        check_true("side stream: made once; fork records on the main stream and the side waits, join the reverse (" +
                       ev_log + ")",
                   ev_log == "CRwrW");
    }

    // errors: one line naming the problem, on every rank alike
    tide_dist_grp bad = {TIDE_DIST_MAX_GROUPS, 0, 1, NULL, &W.comm};
    float x = 1.0f;
    check_true("a group id past the table is an error",
               T.dist_allreduce_sum(&bad, TIDE_F32, &x, 1, NULL) != 0 && strstr(err_buf, "is not a process group"));
    tide_dist_grp nompi = {TIDE_DIST_MAX_GROUPS - 1, 0, 1, NULL, NULL};
    check_true("no MPI communicator to bootstrap over is an error",
               T.dist_allreduce_sum(&nompi, TIDE_F32, &x, 1, NULL) != 0 && strstr(err_buf, "bootstraps over MPI"));
    check_true("an i32 all-reduce is refused by name",
               T.dist_allreduce_sum(&W.d, TIDE_I32, &x, 1, NULL) != 0 && strstr(err_buf, "i32 is not supported"));

    int fails = n_fail;
    MPI_Allreduce(MPI_IN_PLACE, &fails, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (me == 0) printf("nccl (%d ranks): %d passed on rank 0, %d failed over all ranks\n", world, n_pass, fails);
    tide_dist_finalize();
    return fails ? 1 : 0;
}
