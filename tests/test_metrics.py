import torch

from drlcli.metrics import AccuracyReport, accuracy_report, most_confused, summarize_history


def test_accuracy_report_groups_and_old_new():
    class_stage = torch.tensor([1, 1, 2, 2])
    targets = torch.tensor([0, 1, 2, 3, 0, 2])
    preds = torch.tensor([0, 0, 2, 3, 0, 3])
    report = accuracy_report(preds, targets, class_stage, num_stages=2)
    assert report.top1 == round(100 * 4 / 6, 4)
    assert report.groups == {"1": round(100 * 2 / 3, 4), "2": round(100 * 2 / 3, 4)}
    assert report.old == report.groups["1"] and report.new == report.groups["2"]
    assert report.num_images == 6


def test_history_average_last_and_forgetting():
    reports = [
        AccuracyReport(top1=90.0, num_images=10, groups={"1": 90.0}),
        AccuracyReport(top1=80.0, num_images=20, groups={"1": 85.0, "2": 75.0}),
        None,  # a stage evaluated on nothing
        AccuracyReport(top1=70.0, num_images=30, groups={"1": 60.0, "2": 80.0, "4": 70.0}),
    ]
    summary = summarize_history(reports)
    assert summary.accuracy == [90.0, 80.0, None, 70.0]
    assert summary.average == 80.0
    assert summary.last == 70.0
    assert summary.forgetting == {"1": 30.0, "2": -5.0}


def test_accuracy_matrix_and_mean_forgetting():
    reports = [
        AccuracyReport(top1=90.0, num_images=10, groups={"1": 90.0}),
        None,
        AccuracyReport(top1=70.0, num_images=30, groups={"1": 60.0, "2": 80.0, "3": 70.0}),
    ]
    summary = summarize_history(reports)
    assert summary.matrix == [[90.0, None, None], [None, None, None], [60.0, 80.0, 70.0]]
    assert summary.forgetting == {"1": 30.0}  # group 2 has no earlier accuracy
    assert summary.mean_forgetting == 30.0
    assert summarize_history([reports[0]]).mean_forgetting is None


def test_most_confused_pairs_by_count_then_name():
    names = ["cat", "dog", "fox"]
    targets = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    preds = torch.tensor([1, 1, 0, 0, 2, 0, 0, 2])
    assert most_confused(preds, targets, names, top=3) == [
        {"true": "cat", "predicted": "dog", "count": 2},
        {"true": "fox", "predicted": "cat", "count": 2},
        {"true": "dog", "predicted": "cat", "count": 1},
    ]
    assert most_confused(targets, targets, names) == []
    assert len(most_confused(preds, targets, names, top=0)) == 0


def test_top5_counts_a_target_among_the_five_best_classes():
    targets = torch.tensor([0, 1, 2, 3])
    ranked = torch.tensor([[0, 9, 8, 7, 6], [9, 8, 7, 6, 1], [9, 8, 7, 6, 5], [3, 0, 1, 2, 4]])
    stage = torch.tensor([1] * 10)
    report = accuracy_report(ranked[:, 0], targets, stage, num_stages=1, ranked=ranked)
    assert report.top1 == 50.0 and report.top5 == 75.0
    assert accuracy_report(ranked[:, 0], targets, stage, num_stages=1).top5 is None
